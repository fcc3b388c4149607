"""A Python process with TensorFlow imported that forks a fresh process for
each script a test runs (Android's zygote, `multiprocessing`'s forkserver).

`python scripts/train.py ...` spends most of a short test's time importing
TensorFlow and Keras (~5 s a run on 2 cores). Here the import happens once;
each run is `fork()` from this process, before TensorFlow has started its
runtime (no devices, no threads, no eager context: importing does none of
that), so every run still gets its own process with its own exit code,
files, environment and working folder, and TensorFlow initialises in it as
in a fresh interpreter. What a forked run cannot change is what TensorFlow
reads when it loads (TF_ENABLE_ONEDNN_OPTS / --onednn, TF_CPP_MIN_LOG_LEVEL,
PYTHONPATH): `helpers.run_script` runs those in a fresh interpreter, and so
does every run when DISTLOOP_TEST_FRESH_PROCESSES=1.

In its idle time the zygote also does AutoGraph's conversions of the
framework's graph code (tests/autograph_warmup.py), another ~4 s of every
run; DISTLOOP_TEST_AUTOGRAPH_WARMUP=0 leaves them to each run.

Processes the runs start themselves (launch.py's tasks, a benchmark's
children) fork from here too: the runs see tests/zygote_proxy.py's `python`
as `sys.executable`, and tests hand it to launch.py
(`cluster_utils.train_command`). It asks on a Unix socket with the same
request, its stdin, stdout and stderr passed along (SCM_RIGHTS) instead of
file names, and gets the same two replies, or {"fresh": true}: run a new
interpreter instead.

Protocol (one JSON object per line): a request on stdin
  {"script": path, "argv": [...], "cwd": ..., "env": {...},
   "stdout": path, "stderr": path or "STDOUT", "append": bool}
is answered with {"pid": pid} at once, and {"pid": pid, "returncode": code}
when that run ends (negative: killed by that signal, as `subprocess`
says); several runs can be under way. At end of input the zygote kills the
runs still going and exits.
"""

import json
import os
import sys


def _serve(requests, replies, warmup, listener=None):
  import select  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top
  running = set()
  proxied = _PROXIED  # the socket's runs; `running`: the pipe's
  buffered = ""
  watched = [requests] + ([listener] if listener is not None else [])
  while True:
    idle = 0 if warmup is not None and warmup.pending else 0.05
    ready, _, _ = select.select(watched, [], [], idle)
    if not ready and idle == 0:
      warmup.step()  # one conversion, then requests again
    if listener in ready:
      _accept(listener, (requests, replies, listener), proxied)
    if requests in ready:
      chunk = os.read(requests.fileno(), 1 << 16).decode()
      if not chunk:
        break
      buffered += chunk
      while "\n" in buffered:
        line, buffered = buffered.split("\n", 1)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
          _child(json.loads(line), (requests, replies, listener,
                                    *proxied.values()))
        running.add(pid)
        _reply(replies, {"pid": pid})
    for pid in list(running) + list(proxied):
      done, status = os.waitpid(pid, os.WNOHANG)
      if not done:
        continue
      code = os.waitstatus_to_exitcode(status)
      if pid in running:
        running.discard(pid)
        _reply(replies, {"pid": pid, "returncode": code})
      else:
        _send(proxied.pop(pid), {"returncode": code}, close=True)
  for pid in list(running) + list(proxied):
    try:
      os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def _accept(listener, protocol, proxied):
  """Forks the run a zygote_proxy asks for, or tells it to run fresh."""
  import socket  # pylint: disable=g-import-not-at-top
  connection, _ = listener.accept()
  fds = []
  try:
    connection.settimeout(10)
    data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 4)
    while not data.endswith(b"\n"):
      more = connection.recv(1 << 20)
      if not more:
        raise OSError("request cut short")
      data += more
    request = json.loads(data)
    if len(fds) != 4 or needs_fresh_interpreter(
        request["argv"], request["env"], _ZYGOTE_ENV):
      raise OSError("not forkable here")
  except (OSError, ValueError):
    for fd in fds:
      os.close(fd)
    _send(connection, {"fresh": True}, close=True)
    return
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    # Not the other stand-ins' connections either: each sees end of file
    # only when the zygote itself is gone.
    _child(request, (*protocol, connection, *proxied.values()), fds=fds)
  for fd in fds:
    os.close(fd)
  proxied[pid] = connection
  _send(connection, {"pid": pid})


def _send(connection, message, close=False):
  try:
    connection.sendall(json.dumps(message).encode() + b"\n")
  except OSError:
    pass  # the proxy was killed; its run killed itself (see _die_with)
  if close:
    connection.close()


# Read by TensorFlow (or Python) when it loads: a forked run would keep the
# zygote's values.
_LOAD_TIME_ENV = ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL",
                  "TF_ENABLE_ONEDNN_OPTS", "CUDA_VISIBLE_DEVICES",
                  "PYTHONHASHSEED", "PYTHONWARNINGS", "LD_PRELOAD")
# Flags a script acts on before or as TensorFlow loads, or that must see
# the interpreter's own command line (--malloc re-executes it).
_LOAD_TIME_FLAGS = ("--onednn", "--helpfull", "--malloc")
_ZYGOTE_ENV = None  # the environment TensorFlow loaded under (main sets it)


def needs_fresh_interpreter(args, env, zygote_env):
  """Whether `python script args` under `env` must be a new interpreter
  rather than a fork of a zygote whose environment is `zygote_env`."""
  if env.get("DISTLOOP_TEST_FRESH_PROCESSES") == "1":
    return True
  if any(a.startswith(_LOAD_TIME_FLAGS) for a in args):
    return True
  return any(env.get(k) != zygote_env.get(k) for k in _LOAD_TIME_ENV)


def _reply(replies, message):
  replies.write(json.dumps(message) + "\n")
  replies.flush()


class _KeepArgv0:
  """runpy's context for sys.argv[0], minus the change."""

  def __init__(self, value):
    del value

  def __enter__(self):
    return self

  def __exit__(self, *args):
    return False


def _child(request, protocol, fds=None):
  """Becomes `python <script> <argv...>`: never returns. Its stdin, stdout
  and stderr are files the request names, or `fds` (a zygote_proxy's
  three, then its lifeline)."""
  code = 1
  try:
    for f in protocol:
      if f is not None:
        f.close()
    os.setpgid(0, 0)  # the test can kill the run and whatever it started
    if fds:
      for fd, new in zip((0, 1, 2), fds):
        os.dup2(new, fd)
      _die_with(fds[3])
      for new in set(fds[:3]):
        os.close(new)
    else:
      _redirect(request)
    # Its own children are forked from here too (zygote_proxy.py).
    sys.executable = _PROXY_PYTHON or sys.executable
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["script"]
    sys.argv = [script] + request["argv"]
    # As `python script`: __file__ is the path joined to the working folder,
    # sys.path[0] the script's real folder.
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    import runpy  # pylint: disable=g-import-not-at-top
    # run_path would set sys.argv[0] to the joined path too; Python keeps it
    # as typed.
    runpy._ModifiedArgv0 = _KeepArgv0  # pylint: disable=protected-access
    try:
      runpy.run_path(os.path.join(os.getcwd(), script), run_name="__main__")
      code = 0
    except SystemExit as e:
      if e.code is None:
        code = 0
      elif isinstance(e.code, int):
        code = e.code
      else:
        print(e.code, file=sys.stderr)
        code = 1
    except BaseException as e:  # pylint: disable=broad-except
      import traceback  # pylint: disable=g-import-not-at-top
      traceback.print_exc()
      # Python ends on an uncaught KeyboardInterrupt by SIGINT (-2).
      code = -2 if isinstance(e, KeyboardInterrupt) else 1
    # What the interpreter does at exit: non-daemon threads, atexit, flush.
    import threading  # pylint: disable=g-import-not-at-top
    threading._shutdown()  # pylint: disable=protected-access
    import atexit  # pylint: disable=g-import-not-at-top
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    sys.stdout.flush()
    sys.stderr.flush()
  finally:
    if code < 0:
      import signal  # pylint: disable=g-import-not-at-top
      signal.signal(-code, signal.SIG_DFL)
      os.kill(os.getpid(), -code)
    os._exit(code)  # pylint: disable=protected-access


def _redirect(request):
  write = os.O_WRONLY | os.O_CREAT | (
      os.O_APPEND if request.get("append") else os.O_TRUNC)
  for fd, path, mode in ((0, os.devnull, os.O_RDONLY),
                         (1, request["stdout"], write),
                         (2, request["stderr"], write)):
    if path == "STDOUT":
      os.dup2(1, fd)
      continue
    new = os.open(path, mode, 0o644)
    os.dup2(new, fd)
    os.close(new)


def _die_with(lifeline):
  """Kills this process (SIGKILL) when the zygote_proxy that stands in for
  it dies: `kill -9` of the proxy is `kill -9` of the run."""
  import signal  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top

  def watch():
    while os.read(lifeline, 1):
      pass
    os.kill(os.getpid(), signal.SIGKILL)

  threading.Thread(target=watch, daemon=True, name="zygote_proxy").start()


_PROXY_PYTHON = None  # the `python` zygote_proxy.py stands behind
_PROXIED = {}  # pid -> the zygote_proxy connection that stands in for it


def _listen(folder):
  """The socket zygote_proxy.py asks on, and the `python` it runs as."""
  import socket  # pylint: disable=g-import-not-at-top
  global _PROXY_PYTHON
  address = os.path.join(folder, "zygote.sock")
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(address)
  listener.listen(64)
  python = os.path.join(folder, "python")
  tests = os.path.dirname(os.path.abspath(__file__))
  with open(python, "w") as f:
    f.write(f"#!{sys.executable} -S\n"
            f"import sys\n"
            f"sys.path.insert(0, {tests!r})\n"
            f"import zygote_proxy\n"
            f"zygote_proxy.main({sys.executable!r}, {address!r})\n")
  os.chmod(python, 0o755)
  _PROXY_PYTHON = python
  return listener


def main():
  # The protocol keeps its own descriptors; 0 and 1 become the runs' own.
  requests = os.fdopen(os.dup(0), "r")
  replies = os.fdopen(os.dup(1), "w")
  null = os.open(os.devnull, os.O_RDWR)
  os.dup2(null, 0)
  os.dup2(null, 1)
  # What every script imports, before any of them parses flags.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  from scripts import cli  # pylint: disable=g-import-not-at-top,unused-import
  # As in a script: absl's handler is on the root logger before TensorFlow
  # loads (app.run installs it first), so TensorFlow adds no handler of its
  # own to the "tensorflow" logger.
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  absl_logging.use_absl_handler()
  cli.import_tensorflow_quietly()
  import keras  # pylint: disable=g-import-not-at-top,unused-import
  import numpy  # pylint: disable=g-import-not-at-top,unused-import
  warmup = None
  if os.environ.get("DISTLOOP_TEST_AUTOGRAPH_WARMUP", "1") != "0":
    import autograph_warmup  # pylint: disable=g-import-not-at-top
    warmup = autograph_warmup.Warmup()  # imports the framework
    warmup.convert_core()
  del sys.path[0]
  global _ZYGOTE_ENV
  _ZYGOTE_ENV = dict(os.environ)
  import shutil  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  folder = tempfile.mkdtemp(prefix="distloop_zygote_")
  try:
    listener = _listen(folder)
    replies.write(json.dumps({"ready": os.getpid(),
                              "python": _PROXY_PYTHON}) + "\n")
    replies.flush()
    _serve(requests, replies, warmup, listener)
  finally:
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
  main()
