"""The test process's end of tests/zygote.py: one zygote per test process,
started on first use."""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading

_ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
_lock = threading.Lock()
_zygote = None
_environ = None


def environ():
  """The environment the zygote imported TensorFlow under."""
  return _environ if _environ is not None else _zygote_environ()


def _zygote_environ():
  return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")


def _start():
  global _zygote, _environ
  _environ = _zygote_environ()
  _zygote = subprocess.Popen(
      [sys.executable, _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
      env=_environ, text=True, bufsize=1)
  ready = json.loads(_zygote.stdout.readline() or "{}")
  if "ready" not in ready:
    raise RuntimeError(f"the test zygote did not start (exit "
                       f"{_zygote.poll()})")
  atexit.register(_stop)


def _stop():
  if _zygote is not None and _zygote.poll() is None:
    _zygote.stdin.close()
    try:
      _zygote.wait(timeout=10)
    except subprocess.TimeoutExpired:
      _zygote.kill()


def run(script, argv, *, cwd, env, timeout):
  """Like `subprocess.run([python, script, *argv], capture_output=True,
  text=True, timeout=timeout)`, the process forked from the zygote."""
  with _lock, tempfile.TemporaryDirectory(prefix="zygote_") as folder:
    if _zygote is None or _zygote.poll() is not None:
      _start()
    out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
    _zygote.stdin.write(json.dumps({
        "script": script, "argv": argv, "cwd": cwd, "env": env,
        "stdout": out, "stderr": err}) + "\n")
    _zygote.stdin.flush()
    pid = json.loads(_zygote.stdout.readline())["pid"]
    ready, _, _ = select.select([_zygote.stdout], [], [], timeout)
    timed_out = not ready
    if timed_out:
      try:
        os.killpg(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    returncode = json.loads(_zygote.stdout.readline())["returncode"]
    with open(out, errors="replace") as f:
      stdout = f.read()
    with open(err, errors="replace") as f:
      stderr = f.read()
  args = [sys.executable, script, *argv]
  if timed_out:
    raise subprocess.TimeoutExpired(args, timeout, stdout, stderr)
  return subprocess.CompletedProcess(args, returncode, stdout, stderr)
