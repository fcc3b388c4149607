"""One training writer per model_dir.

    with RunLock(model_dir, enabled=is_chief) as lock:
      ...check the configuration, restore...
      lock.record()      # before the first write: who holds the lock
      ...train...

The lock is `fcntl.flock` on model_dir itself (an fd of the directory), so
taking it writes nothing: a run that stops on bad input leaves model_dir
byte-for-byte as it was. `record()` then writes `.distloop.lock` with the
holder's host, pid and start time, which a second writer's one-line error
(`ModelDirError`) names. The kernel drops a flock when its process dies, so
a run killed with -9 leaves a stale `.distloop.lock` but no lock.
Evaluators and predictors only read and take no lock.
"""

import datetime
import errno
import fcntl
import json
import os
import socket

from framework.errors import ConfigError, ModelDirError

# Locks this process holds, for `release_all` before an immediate exit.
_HELD = set()

LOCK_FILE = ".distloop.lock"


def _reason(error):
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
                          f"({_reason(e)})") from None
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
                              f"({_reason(e)})") from None
        who = self.holder()
        raise ModelDirError(
            f"model_dir={self.model_dir!r} is in use by pid "
            f"{who.get('pid', '?')} on host {who.get('host', '?')} since "
            f"{who.get('since', '?')}; wait for that run to end or use "
            "another model_dir") from None
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
      raise ModelDirError(f"cannot write {self.path} ({_reason(e)})"
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

  def __exit__(self, *exc):
    self.release()


def release_all():
  """Releases every lock this process holds (before `os._exit`, which skips
  the `with` blocks that would)."""
  for lock in list(_HELD):
    lock.release()
