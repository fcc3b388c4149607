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

A check that reads a whole file (the CRC-32 pass over an `.npz`) is done
once per file as it is: `record_checked` notes it in distloop's cache folder
(`cache_dir()`, never the data folder, which the readers only read), keyed
by the file's real path, size, mtime and inode, and `checked_before` finds
it until the file changes.
"""

import hashlib
import json
import os
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


def cache_dir():
  """distloop's cache folder: `$DISTLOOP_CACHE_DIR`, else
  `$XDG_CACHE_HOME/distloop`, else `~/.cache/distloop`."""
  if os.environ.get("DISTLOOP_CACHE_DIR"):
    return os.environ["DISTLOOP_CACHE_DIR"]
  base = (os.environ.get("XDG_CACHE_HOME") or
          os.path.join(os.path.expanduser("~"), ".cache"))
  return os.path.join(base, "distloop")


def file_identity(path):
  """What a record of `path` is keyed by: real path, size, mtime, inode.
  Take it before a check, so that a file changed while it was read is not
  recorded as checked."""
  stat = os.stat(path)
  return {"path": os.path.realpath(path), "size": stat.st_size,
          "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}


def _record_path(path, check):
  key = hashlib.sha256(f"{check}\0{os.path.realpath(path)}".encode())
  return os.path.join(cache_dir(), "checked", key.hexdigest()[:32] + ".json")


def checked_before(path, check):
  """Whether `check` (a name) passed on `path` as it is now (a record of
  `record_checked` with its current size, mtime and inode)."""
  try:
    with open(_record_path(path, check)) as f:
      record = json.load(f)
  except (OSError, ValueError):
    return False
  return record == dict(file_identity(path), check=check)


def record_checked(path, check, identity):
  """Records that `check` passed on `path` as `identity` (`file_identity`
  taken before the check) described it; nothing if the file has changed
  since, or the cache folder cannot be written (the check is then redone
  next time)."""
  if file_identity(path) != identity:
    return
  target = _record_path(path, check)
  temporary = f"{target}.{os.getpid()}.tmp"
  try:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(temporary, "w") as f:
      json.dump(dict(identity, check=check), f)
    os.replace(temporary, target)
  except OSError:
    try:
      os.remove(temporary)
    except OSError:
      pass


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
