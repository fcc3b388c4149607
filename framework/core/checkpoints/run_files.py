"""The run's own files in model_dir: atomic writes, the run lock and the run state."""

import datetime
import errno
import fcntl
import glob
import json
import os
import re
import shutil
import socket
import stat

from absl import logging
import tensorflow as tf

from framework.errors import CheckpointError, ModelDirError, ConfigError


TMP_PREFIX = ".tmp_"
# What a process killed inside `write_atomically` can leave behind.
ORPHAN_NAMES = re.compile(
    re.escape(TMP_PREFIX) + r"(model\.weights\.h5|model_info\.json"
    r"|run_config\.json|target_reached\.json|checkpoint|export"
    r"|stopped_early\.json|best_history\.json|spike_batches\.json"
    r"|metrics\.jsonl|goodput\.json)(\.old)?")


def _reason(error):
  """The OS's words for `error` (HDF5 and TensorFlow bury the errno in a
  multi-line message)."""
  code = re.search(r"errno = (\d+)|\[Errno (\d+)\]", str(error))
  if code:
    return os.strerror(int(code.group(1) or code.group(2)))
  if isinstance(error, OSError) and error.strerror:
    return error.strerror.strip().splitlines()[0]
  lines = str(error).strip().splitlines()
  return lines[0] if lines else type(error).__name__


def _remove(path):
  if os.path.isdir(path):
    shutil.rmtree(path, ignore_errors=True)
  elif tf.io.gfile.exists(path):
    tf.io.gfile.remove(path)


def write_atomically(path, write):
  """Calls `write(tmp_path)`, then renames it to `path` (file or directory).

  Raises ModelDirError, naming `path` and the reason (e.g. "No space left on
  device"), if writing or renaming fails; `path` is then unchanged, as it
  is when `write` raises anything else (which propagates).
  """
  directory, name = os.path.split(path)
  tmp = os.path.join(directory, TMP_PREFIX + name)
  old = tmp + ".old"
  try:
    _remove(tmp)
    write(tmp)
    if os.path.isdir(tmp):
      # A directory cannot be renamed over a non-empty one: move the old
      # one aside first (a crash in between leaves it as `old`).
      _remove(old)
      if os.path.isdir(path):
        os.rename(path, old)
      os.rename(tmp, path)
      _remove(old)
    else:
      tf.io.gfile.rename(tmp, path, overwrite=True)
  except Exception as e:  # pylint: disable=broad-except
    # Whatever failed (also `write` itself: a model TensorFlow cannot save),
    # its partial output goes and `path` stays as it was.
    try:
      _remove(tmp)
      if os.path.isdir(old) and not os.path.exists(path):
        os.rename(old, path)
    except OSError:
      pass
    if not isinstance(e, (OSError, tf.errors.OpError)):
      raise
    raise ModelDirError(
        f"cannot write {path} ({_reason(e)}); "
        + ("the previous version is unchanged"
           if os.path.exists(path) else "nothing was written")) from None
  return path


# The largest run record `read_json` reads: a run writes a few KiB; a
# multi-GiB file put in its place would be read whole into memory.
MAX_JSON_BYTES = 64 << 20


def _check_local_file(path, remedy):
  """A local run record must be a file (or a directory, refused when read):
  opening a FIFO put in its place would block forever, a device reads
  without end, and a symlink to nothing would read as no record at all."""
  try:
    mode = os.stat(path).st_mode
  except FileNotFoundError:
    if os.path.islink(path):
      raise CheckpointError(
          f"{path} is a symlink to {os.readlink(path)!r}, which does not "
          f"exist{remedy}") from None
    return
  except OSError as e:
    raise CheckpointError(f"cannot read {path} ({_reason(e)}){remedy}"
                          ) from None
  if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
    raise CheckpointError(
        f"{path} is not a regular file (a FIFO, socket or device in its "
        f"place){remedy}")


def read_json(path, remedy="", *, object_only=False):
  """The JSON at `path`, or None when there is no such file.

  Raises CheckpointError, in one line ending in `remedy`, when it is not
  valid JSON (a file half-written by hand, or damaged), larger than
  `MAX_JSON_BYTES`, cannot be read (a directory in its place) or, with
  `object_only`, holds no JSON object (`[]`, `null`: a file the run wrote
  always holds one).
  """
  if "://" not in path:
    _check_local_file(path, remedy)
  if not tf.io.gfile.exists(path):
    return None
  try:
    size = tf.io.gfile.stat(path).length
  except tf.errors.OpError as e:
    raise CheckpointError(
        f"cannot read {path} ({_reason(e)}){remedy}") from None
  if size > MAX_JSON_BYTES:
    raise CheckpointError(
        f"{path} holds {size} bytes, more than a run record's "
        f"{MAX_JSON_BYTES} (replaced or damaged){remedy}")
  try:
    with tf.io.gfile.GFile(path) as f:
      value = json.load(f)
  except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
    raise CheckpointError(f"{path} is not valid JSON ({e}){remedy}") from None
  except tf.errors.OpError as e:  # a directory in its place, unreadable
    raise CheckpointError(
        f"cannot read {path} ({_reason(e)}){remedy}") from None
  if object_only and not isinstance(value, dict):
    raise CheckpointError(
        f"{path} holds {json.dumps(value)[:40]}, not a JSON object (edited "
        f"or damaged){remedy}")
  return value


def write_text(path, text):
  """`write_atomically` for a text file."""

  def write(tmp):
    with tf.io.gfile.GFile(tmp, "w") as f:
      f.write(text)

  return write_atomically(path, write)


# Whether a run already stopped at its target accuracy, or early.
#
# A run that stops at `stop_at_accuracy` saves its checkpoint, then the chief
# writes `target_reached.json` beside it (atomically):
#
#     {"step": 5, "accuracy": 0.83, "stop_at_accuracy": 0.8, "train_steps": 40,
#      "time_to_target_seconds": 12.3, "metrics": {...the final eval...}}
#
# Relaunched with the same flags, the run restores that checkpoint and
# `finished_at_target` says it is done: nothing trains, no checkpoint is
# written, the time to target is not measured again. Raising `train_steps`
# (or `--epochs`) or the target above the accuracy reached, or dropping the
# target, continues the run, which then removes the record. A record of
# another step (a later checkpoint was restored) is ignored.
#
# A run stopped by early stopping (`early_stopping_patience`) records
# `stopped_early.json` the same way: `{"step", "reason", "best_metric",
# "patience", "train_steps", "metrics"}`; relaunched with the same
# `best_metric` and no larger patience it trains nothing. A larger
# patience, or none, continues it.
TARGET_FILE = "target_reached.json"
STOP_FILE = "stopped_early.json"


def record_target(model_dir, *, step, accuracy, stop_at_accuracy,
                  train_steps, time_to_target, metrics):
  """Writes the record (the chief, after the checkpoint at `step`)."""
  record = {"step": int(step), "accuracy": float(accuracy),
            "stop_at_accuracy": float(stop_at_accuracy),
            "train_steps": int(train_steps),
            "time_to_target_seconds": float(time_to_target),
            "metrics": {k: float(v) for k, v in metrics.items()}}
  write_text(os.path.join(model_dir, TARGET_FILE),
                    json.dumps(record, indent=2, sort_keys=True))


def read_target(model_dir, name=TARGET_FILE):
  """The record `record_target` (or `record_early_stop`, with `name=
  STOP_FILE`) wrote, or None (none, or unreadable: then the run trains on,
  as without a record)."""
  path = os.path.join(model_dir, name)
  try:
    if not tf.io.gfile.exists(path):
      return None
    with tf.io.gfile.GFile(path) as f:
      record = json.load(f)
    int(record["step"]), int(record["train_steps"])
    if name == TARGET_FILE:
      float(record["accuracy"])
    else:
      int(record["patience"]), str(record["best_metric"])
    return record
  except (ValueError, TypeError, KeyError, UnicodeDecodeError,
          tf.errors.OpError) as e:
    logging.warning("Ignoring %s (%s)", path, e)
    return None


def forget_target(model_dir, name=TARGET_FILE):
  """Removes the record (a run that goes on from it is no longer done)."""
  path = os.path.join(model_dir, name)
  if tf.io.gfile.exists(path):
    tf.io.gfile.remove(path)


def finished_at_target(record, step, train_steps, stop_at_accuracy):
  """Whether `record` says a run restored at `step` with these settings has
  nothing left to do."""
  return (record is not None and stop_at_accuracy is not None
          and int(record["step"]) == step
          and train_steps <= int(record["train_steps"])
          and stop_at_accuracy <= float(record["accuracy"]))


def continues_past_target(record, step, stop_at_accuracy):
  """Whether a run restored at `step` goes on past a target it already met
  (the same or a lower `stop_at_accuracy`), with more steps to train."""
  return (record is not None and stop_at_accuracy is not None
          and step >= int(record["step"])
          and stop_at_accuracy <= float(record["accuracy"]))


def record_early_stop(model_dir, *, step, reason, best_metric, patience,
                      train_steps, metrics):
  """Writes the early-stopping record (the chief, after the checkpoint at
  `step`)."""
  record = {"step": int(step), "reason": str(reason),
            "best_metric": str(best_metric), "patience": int(patience),
            "train_steps": int(train_steps),
            "metrics": {k: float(v) for k, v in (metrics or {}).items()}}
  write_text(os.path.join(model_dir, STOP_FILE),
                    json.dumps(record, indent=2, sort_keys=True))


def finished_early(record, step, best_metric, patience):
  """Whether the early-stopping `record` says a run restored at `step` with
  these settings has nothing left to do."""
  return (record is not None and patience is not None
          and int(record["step"]) == step
          and record["best_metric"] == best_metric
          and patience <= int(record["patience"]))


# One training writer per model_dir.
#
#     with RunLock(model_dir, enabled=is_chief) as lock:
#       ...check the configuration, restore...
#       lock.record()      # before the first write: who holds the lock
#       ...train...
#
# The lock is `fcntl.flock` on model_dir itself (an fd of the directory), so
# taking it writes nothing: a run that stops on bad input leaves model_dir
# byte-for-byte as it was. `record()` then writes `.distloop.lock` with the
# holder's host, pid and start time, which a second writer's one-line error
# (`ModelDirError`) names. The kernel drops a flock when its process dies, so
# a run killed with -9 leaves a stale `.distloop.lock` but no lock.
# Evaluators and predictors only read and take no lock.
# Locks this process holds, for `release_all` before an immediate exit.
_HELD = set()

LOCK_FILE = ".distloop.lock"


def _lock_reason(error):
  return error.strerror or str(error)


class RunLock:
  """Holds `model_dir`'s lock between `acquire` and `release` (or `with`).

  Args:
    model_dir: the run's directory (created if missing; removed again on
      release if nothing was written into it).
    enabled: False for processes that do not write model_dir (e.g. the
      non-chief workers of a multi-worker job): then it does nothing.
  """

  def __init__(self, model_dir, *, enabled=True):
    if not model_dir:
      raise ConfigError("model_dir must be set (got an empty string)")
    self.model_dir = model_dir
    self.enabled = enabled
    self.path = os.path.join(model_dir, LOCK_FILE)
    self._fd = None
    self._created_dir = False
    self._recorded = False

  def _make_dir(self):
    if os.path.isdir(self.model_dir):
      return
    if os.path.exists(self.model_dir):
      raise ModelDirError(f"model_dir={self.model_dir!r} is a file, not a "
                          "directory")
    try:
      os.makedirs(self.model_dir)
    except OSError as e:
      raise ModelDirError(f"model_dir={self.model_dir!r} cannot be created "
                          f"({_lock_reason(e)})") from None
    self._created_dir = True

  def _check_writable(self):
    if os.access(self.model_dir, os.W_OK | os.X_OK):
      return
    read_only = os.statvfs(self.model_dir).f_flag & os.ST_RDONLY
    raise ModelDirError(
        f"model_dir={self.model_dir!r} is not writable ("
        + ("read-only file system" if read_only else "permission denied")
        + ")")

  def holder(self):
    """The dict `record()` wrote ({} if none or unreadable)."""
    try:
      with open(self.path) as f:
        return json.load(f)
    except (OSError, ValueError):
      return {}

  def acquire(self):
    if not self.enabled or self._fd is not None:
      return self
    try:
      self._make_dir()
      self._check_writable()
      fd = os.open(self.model_dir, os.O_RDONLY | os.O_DIRECTORY)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
          raise ModelDirError(f"cannot lock model_dir={self.model_dir!r} "
                              f"({_lock_reason(e)})") from None
        who = self.holder()
        if who.get("pid") is None:
          # The holder records itself just before its first write: it is
          # still starting (or is not a training run).
          holder = ("another process (still starting: it has not "
                    f"recorded itself in {LOCK_FILE} yet)")
        else:
          holder = (f"pid {who['pid']} on host {who.get('host', '?')} "
                    f"since {who.get('since', '?')}")
        raise ModelDirError(
            f"model_dir={self.model_dir!r} is in use by {holder}; wait for "
            "that run to end or use another model_dir") from None
    except ModelDirError:
      self._remove_created_dir()
      raise
    self._fd = fd
    _HELD.add(self)
    return self

  def record(self):
    """Writes who holds the lock to `.distloop.lock` (call before the first
    write into model_dir)."""
    if self._fd is None:
      return
    record = json.dumps({
        "host": socket.gethostname(), "pid": os.getpid(),
        "since": datetime.datetime.now().isoformat(timespec="seconds")})
    try:
      with open(self.path, "w") as f:
        f.write(record + "\n")
    except OSError as e:
      try:
        os.remove(self.path)
      except OSError:
        pass
      raise ModelDirError(f"cannot write {self.path} ({_lock_reason(e)})"
                          ) from None
    self._recorded = True

  def release(self):
    if self._fd is None:
      return
    _HELD.discard(self)
    if self._recorded:
      try:
        os.remove(self.path)
      except OSError:
        pass
    os.close(self._fd)
    self._fd = None
    self._recorded = False
    self._remove_created_dir()

  def _remove_created_dir(self):
    if self._created_dir:
      try:
        os.rmdir(self.model_dir)  # only if empty
      except OSError:
        pass
      self._created_dir = False

  def __enter__(self):
    return self.acquire()

  def __exit__(self, exc_type, exc, traceback):
    created = self._created_dir
    self.release()
    if (created and exc_type is not None and issubclass(exc_type, ConfigError)
        and os.path.isdir(self.model_dir)
        and not glob.glob(os.path.join(glob.escape(self.model_dir),
                                       "ckpt-*"))):
      # Bad input found once the run had begun writing (e.g. at the first
      # trace of its step), before any checkpoint: the folder this run
      # created goes again, as it was.
      shutil.rmtree(self.model_dir, ignore_errors=True)


def release_all():
  """Releases every lock this process holds (before `os._exit`, which skips
  the `with` blocks that would)."""
  for lock in list(_HELD):
    lock.release()
