"""Which checkpoints can be restored: read in full before trusting one.

A checkpoint is intact when its index and every data file exist and every
tensor reads back with a valid checksum. `latest_intact` walks the state
file's list newest first and returns the newest intact one, naming each
damaged newer one, so that a run killed mid-save or a disk that lost a file
resumes from what is really there, never silently from scratch.
"""

import os
import re

from absl import logging
import tensorflow as tf

from framework.core import checkpoint_state
from framework.core.config import RESTORE_POLICIES
from framework.errors import CheckpointError, check_choice, first_line


def damage(prefix):
  """None if checkpoint `prefix` reads back in full, else what is wrong.

  The answer names the damaged file: a missing index or data file, or a
  data file that is short or fails its checksum when every tensor is read.
  """
  index = prefix + ".index"
  if not tf.io.gfile.exists(index):
    return f"{index} is missing"
  data = sorted(tf.io.gfile.glob(prefix + ".data-*-of-*"))
  shards = {int(m.group(1)) for m in (re.search(r"-of-(\d+)$", d)
                                      for d in data) if m}
  for count in shards:
    for i in range(count):
      name = f"{prefix}.data-{i:05d}-of-{count:05d}"
      if name not in data:
        return f"{name} is missing"
  try:
    reader = tf.train.load_checkpoint(prefix)
  except Exception as e:  # pylint: disable=broad-except
    return f"{index} cannot be read ({first_line(e)})"
  try:
    for name in sorted(reader.get_variable_to_shape_map()):
      reader.get_tensor(name)
  except Exception as e:  # pylint: disable=broad-except
    named = re.search(r"\S+\.data-\d{5}-of-\d{5}", str(e))
    if named and not tf.io.gfile.exists(named.group(0)):
      return f"{named.group(0)} is missing"
    # The bundle reader names the shard ("shard 1") or nothing at all.
    shard = re.search(r"shard (\d+)", str(e))
    named = [d for d in data if shard and d.endswith(
        f".data-{int(shard.group(1)):05d}-of-{len(data):05d}")]
    files = " or ".join(named or data) or f"{prefix}.data-*"
    return f"{files} is damaged ({first_line(e)})"
  return None


def _listed_checkpoints(directory):
  """The checkpoints the state file lists, oldest first (None: no state).

  An unreadable state file (garbled, empty) is named in a warning and the
  checkpoints are those found from their own files.

  `get_checkpoint_state` joins relative entries onto the directory it is
  given, so an absolute directory makes every entry absolute, whatever form
  the state file stores.
  """
  directory = absolute(directory)
  found = checkpoint_state.recovered(directory)
  if found is not None:  # a garbled state file: the files themselves
    return found
  try:
    state = tf.train.get_checkpoint_state(directory)
  except Exception as e:  # pylint: disable=broad-except  (a parse error)
    raise CheckpointError(f"the checkpoint state file {directory}/checkpoint "
                          f"is corrupt ({first_line(e)})") from None
  if state is None:
    return None
  paths = list(state.all_model_checkpoint_paths)
  if state.model_checkpoint_path and state.model_checkpoint_path not in paths:
    paths.append(state.model_checkpoint_path)
  return [p if os.path.isabs(p) or "://" in p else os.path.join(directory, p)
          for p in paths]


def absolute(path):
  """`path` made absolute, unless it is a URL (gs://, hdfs://, ...)."""
  return path if "://" in path else os.path.abspath(path)


def latest_intact(directory, restore_policy="latest_intact"):
  """(newest intact checkpoint or None, [(damaged path, problem), ...]).

  Reads only. Damaged checkpoints newer than the one returned are logged as
  warnings. Raises CheckpointError if the newest is damaged and the policy
  is "error", or if checkpoint files exist but none is intact.
  """
  check_choice("restore_policy", restore_policy, RESTORE_POLICIES)
  paths = _listed_checkpoints(directory) or []
  damaged = []
  for path in reversed(paths):
    problem = damage(path)
    if problem is None:
      for bad, why in damaged:
        logging.warning("Checkpoint %s is damaged: %s; restoring the newest "
                        "intact checkpoint, %s, instead", bad, why, path)
      return path, damaged
    if restore_policy == "error":
      raise CheckpointError(
          f"checkpoint {path} is damaged: {problem}; restore the file, or "
          "use restore=latest_intact to resume from the newest intact "
          "checkpoint")
    damaged.append((path, problem))
  if any(tf.io.gfile.glob(p + ".*") for p, _ in damaged):
    raise CheckpointError(
        "no intact checkpoint to resume from: " + "; ".join(
            why for _, why in damaged) + "; refusing to start from scratch: "
        "restore the files or move the ckpt-* files away")
  if damaged:
    logging.warning("The checkpoint state in %s lists %s but none of their "
                    "files exist; starting from scratch", directory,
                    ", ".join(os.path.basename(p) for p, _ in damaged))
  return None, []
