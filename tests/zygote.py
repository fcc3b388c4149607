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


def _serve(requests, replies, warmup):
  import select  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top
  running = set()
  buffered = ""
  while True:
    idle = 0 if warmup is not None and warmup.pending else 0.05
    ready, _, _ = select.select([requests], [], [], idle)
    if not ready and idle == 0:
      warmup.step()  # one conversion, then requests again
    if ready:
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
          _child(json.loads(line), (requests, replies))  # never returns
        running.add(pid)
        _reply(replies, {"pid": pid})
    for pid in list(running):
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        running.discard(pid)
        _reply(replies, {"pid": pid,
                         "returncode": os.waitstatus_to_exitcode(status)})
  for pid in running:
    try:
      os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def _reply(replies, message):
  replies.write(json.dumps(message) + "\n")
  replies.flush()


def _child(request, protocol):
  """Becomes `python <script> <argv...>`: never returns."""
  code = 1
  try:
    for f in protocol:
      f.close()
    os.setpgid(0, 0)  # the test can kill the run and whatever it started
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
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["script"]
    sys.argv = [script] + request["argv"]
    sys.path[0] = os.path.dirname(script)
    import runpy  # pylint: disable=g-import-not-at-top
    try:
      runpy.run_path(script, run_name="__main__")
      code = 0
    except SystemExit as e:
      if e.code is None:
        code = 0
      elif isinstance(e.code, int):
        code = e.code
      else:
        print(e.code, file=sys.stderr)
        code = 1
    except BaseException:  # pylint: disable=broad-except
      import traceback  # pylint: disable=g-import-not-at-top
      traceback.print_exc()
      code = 1
    # What the interpreter does at exit: non-daemon threads, atexit, flush.
    import threading  # pylint: disable=g-import-not-at-top
    threading._shutdown()  # pylint: disable=protected-access
    import atexit  # pylint: disable=g-import-not-at-top
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    sys.stdout.flush()
    sys.stderr.flush()
  finally:
    os._exit(code)  # pylint: disable=protected-access


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
  del sys.path[0]
  replies.write(json.dumps({"ready": os.getpid()}) + "\n")
  replies.flush()
  _serve(requests, replies, warmup)


if __name__ == "__main__":
  main()
