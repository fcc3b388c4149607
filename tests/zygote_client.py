"""The test process's end of tests/zygote.py: one zygote per test process,
started on first use; `popen` and `run` are `subprocess.Popen` and
`subprocess.run` for a Python script whose process is forked from it."""

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

_ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
_WARMUP = "DISTLOOP_TEST_AUTOGRAPH_WARMUP"
_requests = threading.Lock()  # one request and its pid reply at a time
_lock = threading.Lock()
_ended = threading.Condition(_lock)
_zygote = None
_environ = None
_python = None  # the zygote's zygote_proxy `python`
_returncodes = {}  # pid -> exit status, as the zygote reports them
_started = []  # pids of new runs, in request order, not yet handed out
_dead = {}  # zygote (Popen) -> its exit status; its runs' are unknown


def environ():
  """The environment the zygote imported TensorFlow under."""
  return _environ if _environ is not None else _zygote_environ()


def _zygote_environ():
  return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")


def _start():
  """Starts the zygote (under _lock) and the thread that reads its
  replies."""
  global _zygote, _environ, _python
  _environ = _zygote_environ()
  _zygote = subprocess.Popen(
      [sys.executable, _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
      env=_environ, text=True, bufsize=1)
  ready = json.loads(_zygote.stdout.readline() or "{}")
  if "ready" not in ready:
    raise RuntimeError(f"the test zygote did not start (exit "
                       f"{_zygote.poll()})")
  _python = ready.get("python")
  threading.Thread(target=_read_replies, args=(_zygote, _python),
                   daemon=True).start()
  atexit.register(_stop)


def _start_if_needed():
  """A zygote that serves (under _requests and _lock): this one or a new
  one."""
  if _zygote is None or _zygote.poll() is not None:
    _started.clear()
    _start()


def _read_replies(zygote, python):
  for line in zygote.stdout:
    reply = json.loads(line)
    with _lock:
      if "returncode" in reply:
        _returncodes[reply["pid"]] = reply["returncode"]
        _ended.notify_all()
      else:  # a new run: a recycled pid's old status is not its status
        _returncodes.pop(reply["pid"], None)
        _started.append(reply["pid"])
        _ended.notify_all()
  # End of its output: the zygote is gone, and with it the statuses of the
  # runs still going. Waiting for them would hang; waiters raise instead.
  status = zygote.wait()
  if python:  # its folder, which a killed zygote leaves behind
    shutil.rmtree(os.path.dirname(python), ignore_errors=True)
  with _lock:
    _dead[zygote] = status
    _ended.notify_all()


def _check_alive(zygote, args):
  if zygote in _dead:
    raise RuntimeError(f"the test zygote exited (status {_dead[zygote]}) "
                       f"before reporting on {args}")


def _stop(zygote=None):
  zygote = zygote or _zygote
  if zygote is not None and zygote.poll() is None:
    zygote.stdin.close()
    try:
      zygote.wait(timeout=10)
    except subprocess.TimeoutExpired:
      zygote.kill()


@contextlib.contextmanager
def separate_zygote():
  """Runs the block against zygotes of its own (no AutoGraph warm-up), then
  stops them and goes back to this process's zygote: for tests that kill
  the zygote, so the other tests' zygote and its warm-up survive."""
  global _zygote, _environ, _python
  with _requests, _lock:
    saved = _zygote, _environ, _python
    _zygote, _environ, _python = None, None, None
    _started.clear()
  before = os.environ.get(_WARMUP)
  os.environ[_WARMUP] = "0"
  try:
    yield
  finally:
    if before is None:
      del os.environ[_WARMUP]
    else:
      os.environ[_WARMUP] = before
    with _requests, _lock:
      own = _zygote
      _zygote, _environ, _python = saved
      _started.clear()
    _stop(own)


class Process:
  """The part of `subprocess.Popen` the tests use, for a forked run."""

  def __init__(self, args, pid, zygote):
    self.args = args
    self.pid = pid
    self.returncode = None
    self._zygote = zygote

  def poll(self):
    with _lock:
      self.returncode = _returncodes.get(self.pid)
    return self.returncode

  def wait(self, timeout=None):
    with _lock:
      if not _ended.wait_for(
          lambda: self.pid in _returncodes or self._zygote in _dead, timeout):
        raise subprocess.TimeoutExpired(self.args, timeout)
      if self.pid not in _returncodes:
        _check_alive(self._zygote, self.args)
      self.returncode = _returncodes[self.pid]
    return self.returncode

  def send_signal(self, sig):
    if self.poll() is None:
      try:
        os.kill(self.pid, sig)
      except ProcessLookupError:
        pass

  def terminate(self):
    self.send_signal(signal.SIGTERM)

  def kill(self):
    self.send_signal(signal.SIGKILL)


def python():
  """A `python` executable whose `python script.py ...` runs fork from this
  process's zygote (tests/zygote_proxy.py), for command lines that another
  process starts (launch.py's tasks); `sys.executable` under
  DISTLOOP_TEST_FRESH_PROCESSES=1."""
  if os.environ.get("DISTLOOP_TEST_FRESH_PROCESSES") == "1":
    return sys.executable
  with _requests, _lock:
    _start_if_needed()
    return _python or sys.executable


def popen(script, argv, *, cwd, env, stdout, stderr, append=False):
  """Starts `python script argv...` forked from the zygote; its output goes
  to the files `stdout` and `stderr` (`"STDOUT"`: with stdout)."""
  with _requests, _lock:
    _start_if_needed()
    _zygote.stdin.write(json.dumps({
        "script": script, "argv": list(argv), "cwd": str(cwd),
        "env": dict(env), "stdout": str(stdout), "stderr": str(stderr),
        "append": append}) + "\n")
    _zygote.stdin.flush()
    zygote = _zygote
    _ended.wait_for(lambda: _started or zygote in _dead)
    if not _started:
      _check_alive(zygote, [script, *argv])
    pid = _started.pop(0)
  return Process([sys.executable, script, *argv], pid, zygote)


def run(script, argv, *, cwd, env, timeout):
  """Like `subprocess.run([python, script, *argv], capture_output=True,
  text=True, timeout=timeout)`, the process forked from the zygote."""
  with tempfile.TemporaryDirectory(prefix="zygote_") as folder:
    out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
    process = popen(script, argv, cwd=cwd, env=env, stdout=out, stderr=err)
    try:
      process.wait(timeout)
      timed_out = False
    except subprocess.TimeoutExpired:
      timed_out = True
      try:
        os.killpg(process.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      process.wait()
    with open(out, errors="replace") as f:
      stdout = f.read()
    with open(err, errors="replace") as f:
      stderr = f.read()
  if timed_out:
    raise subprocess.TimeoutExpired(process.args, timeout, stdout, stderr)
  return subprocess.CompletedProcess(process.args, process.returncode, stdout,
                                     stderr)
