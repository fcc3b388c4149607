"""Checks that the records read are the records written.

A TFRecord shard is read through `checked_shard`: it counts the records and
folds their fingerprints (farmhash64, XOR) as they stream, and a shard that
ends early, runs long, holds other records, or cannot be read (a bit flip
fails TFRecord's CRC; a missing file) fails the pipeline with a message
naming the shard. The failure comes when the shard's last record is read,
and file_input reads each group of shards whole before emitting any of its
examples, so a damaged shard never reaches a training step.

Errors raised inside a `tf.data` graph surface as `InvalidArgumentError`;
their message carries `MARKER`, and `data_error(e)` turns such an error back
into the one-line `DataError` it stands for (the scripts and the Controller
call it).
"""

import hashlib
import re

import numpy as np

from framework.errors import DataError

MARKER = "distloop-data-error"
_MESSAGE = re.compile(re.escape(MARKER) + r"\[\[(.*?)\]\]", re.S)


def fail_message(*parts):
  """A string tensor: `parts` (strings, tensors) joined, wrapped in the
  marker that `data_error` finds."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.strings.join([MARKER + "[["] + [
      p if isinstance(p, str) else tf.strings.as_string(p) for p in parts] +
                         ["]]"])


def check(condition, *parts):
  """A bool tensor (True) that fails with `fail_message(*parts)` unless
  `condition`; the message is formatted only when it fails. `parts` may
  hold callables returning a tensor (evaluated only then)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def fail():
    message = fail_message(*[p() if callable(p) else p for p in parts])
    with tf.control_dependencies([tf.debugging.Assert(
        condition, [message], summarize=1)]):
      return tf.constant(True)

  return tf.cond(condition, lambda: tf.constant(True), fail)


def data_error(error):
  """The `DataError` an error raised by a checked pipeline stands for, or
  None if it is not one."""
  match = _MESSAGE.search(str(error))
  if match is None:
    return None
  return DataError(match.group(1))


def record_fingerprints(records):
  """int64 [n]: farmhash64 of each serialized record (a string tensor)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.reshape(tf.bitcast(tf.fingerprint(records), tf.int64), [-1])


def fold_fingerprints(records):
  """The shard fingerprint of a list of serialized records: 16 hex digits
  (XOR of their farmhash64s, as `checked_shard` folds them)."""
  if not records:
    return f"{0:016x}"
  folded = np.bitwise_xor.reduce(record_fingerprints(records).numpy())
  return f"{int(folded) & (2**64 - 1):016x}"


def fingerprint_value(text):
  """The int64 that `checked_shard` compares with a sidecar's 16 hex
  digits."""
  value = int(text, 16)
  return value - (1 << 64) if value >= 1 << 63 else value


def file_sha256(path, chunk=1 << 22):
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(chunk), b""):
      digest.update(block)
  return digest.hexdigest()


def checked_shard(path, count, fingerprint=None):
  """`tf.data.Dataset` of the records of the TFRecord file `path` (a scalar
  string tensor), failing unless it holds exactly `count` (int64 tensor)
  records whose folded fingerprint is `fingerprint` (an int64 tensor, see
  `fingerprint_value`; None: not checked)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  count = tf.cast(count, tf.int64)
  # An unreadable record (CRC, truncation, a missing file) ends the shard
  # here; the count below names it.
  records = tf.data.TFRecordDataset(path).ignore_errors()
  end = tf.data.Dataset.from_tensors((tf.constant(b""), True))
  flagged = records.map(lambda r: (r, False)).concatenate(end)

  def step(state, item):
    n, folded = state
    record, is_end = item
    bits = record_fingerprints(tf.reshape(record, [1]))[0]
    folded = tf.where(is_end, folded, tf.bitwise.bitwise_xor(folded, bits))
    advice = (" (truncated, corrupted, missing or replaced; re-convert it, "
              "or run make_tfrecords.py --verify on its folder)")
    ops = [check(tf.logical_or(tf.logical_not(is_end), tf.equal(n, count)),
                 "shard ", path, " is damaged: it ends after ", n, " of the ",
                 count, " records its sidecar lists", advice),
           check(tf.logical_or(is_end, n < count),
                 "shard ", path, " is damaged: it holds more than the ",
                 count, " records its sidecar lists", advice)]
    if fingerprint is not None:
      ok = tf.logical_or(tf.logical_not(is_end), tf.equal(folded, fingerprint))
      ops.append(check(
          ok, "shard ", path, " holds other records than its sidecar lists "
          "(record fingerprint ", lambda: _hex64(folded), ", expected ",
          lambda: _hex64(fingerprint), "; re-convert it)"))
    with tf.control_dependencies(ops):
      n = tf.where(is_end, n, n + 1)
      return (n, folded), (tf.identity(record), is_end)

  zero = tf.constant(0, tf.int64)
  checked = flagged.scan((zero, zero), step)
  return checked.filter(lambda r, is_end: tf.logical_not(is_end)).map(
      lambda r, is_end: r)


def _hex64(value):
  """16 hex digits of an int64 tensor read as unsigned."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  digits = tf.constant(list("0123456789abcdef"))
  shifts = tf.constant(list(range(60, -4, -4)), tf.int64)
  nibbles = tf.bitwise.bitwise_and(
      tf.bitwise.right_shift(value, shifts), 15)
  # right_shift of a negative int64 is arithmetic: the mask keeps 4 bits.
  return tf.strings.reduce_join(tf.gather(digits, nibbles))
