"""The `checkpoint` state file: read strictly, and rebuilt when garbled.

TensorFlow's `get_checkpoint_state` logs a `ParseError` and returns None
for a state file it cannot parse, which reads the same as no state file:
a run with intact `ckpt-*` files would then look like one with no
checkpoint at all. Here a state file that exists but does not parse (or is
empty, or names no checkpoint) is *unreadable*, with the reason; the
checkpoints are then found from their own files (`ckpt-<N>.index`,
`ckpt-<N>.data-*`), and the training chief rewrites the state file from
them, atomically, so that the next run reads it cleanly.
"""

import os
import re

from absl import logging
from google.protobuf import text_format
import tensorflow as tf

from framework.core import atomic

STATE_FILE = "checkpoint"
_CHECKPOINT_FILE = re.compile(r"ckpt-(\d+)\.(index|data-\d{5}-of-\d{5})")
# (directory, problem) pairs already warned about: `evaluate.py --watch`
# looks the checkpoints up on every poll.
_warned = set()


def _first_line(text):
  lines = str(text).strip().splitlines()
  return lines[0] if lines else ""


def _empty_state():
  # The public API builds a CheckpointState only through this function.
  state = tf.compat.v1.train.generate_checkpoint_state_proto("/", "/x")
  state.Clear()
  return state


def problem(directory):
  """Why `directory`'s state file is unreadable; None if it reads (or is
  absent: that is no state, not a damaged one)."""
  path = os.path.join(directory, STATE_FILE)
  if not tf.io.gfile.exists(path):
    return None
  try:
    with tf.io.gfile.GFile(path, "rb") as f:
      text = f.read().decode("utf-8")
  except UnicodeDecodeError:
    return "it is not text"
  except tf.errors.OpError as e:
    return f"it cannot be read: {_first_line(e.message)}"
  if not text.strip():
    return "it is empty"
  state = _empty_state()
  try:
    text_format.Merge(text, state)
  except text_format.ParseError as e:
    return f"it does not parse: {_first_line(e)}"
  if not state.model_checkpoint_path:
    return "it names no checkpoint (no model_checkpoint_path)"
  return None


def on_disk(directory):
  """The `ckpt-<N>` prefixes that have files in `directory`, oldest
  (lowest N) first; a prefix with only some of its files is included, so
  that the damage check names what is missing."""
  numbers = set()
  for name in tf.io.gfile.listdir(directory):
    match = _CHECKPOINT_FILE.fullmatch(name.rstrip("/"))
    if match:
      numbers.add(int(match.group(1)))
  return [os.path.join(directory, f"ckpt-{n}") for n in sorted(numbers)]


def recovered(directory):
  """The checkpoints found from their own files when the state file is
  unreadable (warned once per folder and reason), else None."""
  why = problem(directory)
  if why is None:
    return None
  found = on_disk(directory)
  if (directory, why) not in _warned:
    _warned.add((directory, why))
    logging.warning(
        "The checkpoint state file %s is unreadable (%s); using the "
        "checkpoints found from their own files: %s", os.path.join(
            directory, STATE_FILE), why,
        ", ".join(os.path.basename(p) for p in found) or "none")
  return found


def rebuild(directory):
  """Rewrites an unreadable state file from the checkpoints' own files
  (atomically; their files' times as the checkpoints' times), or
  removes it when there are none. Returns the reason it was unreadable,
  or None (nothing written)."""
  why = problem(directory)
  if why is None:
    return None
  path = os.path.join(directory, STATE_FILE)
  found = on_disk(directory)
  if not found:
    tf.io.gfile.remove(path)
    logging.warning("Removed the unreadable checkpoint state file %s (%s); "
                    "no checkpoint files beside it", path, why)
    return why
  names = [os.path.basename(p) for p in found]
  times = [max(tf.io.gfile.stat(f).mtime_nsec / 1e9
               for f in tf.io.gfile.glob(p + ".*")) for p in found]
  state = tf.compat.v1.train.generate_checkpoint_state_proto(
      directory, names[-1], all_model_checkpoint_paths=list(names),
      all_model_checkpoint_timestamps=times,
      # Older than every checkpoint: TensorFlow's manager never rotates
      # (nor lists again) one stamped at or before it.
      last_preserved_timestamp=min(times) - 1)
  atomic.write_text(path, text_format.MessageToString(state))
  logging.warning("The checkpoint state file %s was unreadable (%s); "
                  "rewrote it from the checkpoints' own files: %s", path,
                  why, ", ".join(names))
  return why


def latest(directory):
  """`tf.train.latest_checkpoint(directory)`, but from the checkpoints' own
  files when the state file is unreadable (the newest ckpt-<N>)."""
  found = recovered(directory)
  if found is None:
    return tf.train.latest_checkpoint(directory)
  return found[-1] if found else None
