"""A run forked from the test zygote behaves as `python script.py` would."""

import ast
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import helpers
import zygote_client

SCRIPT = """
import json, os, sys, threading, time, atexit
atexit.register(lambda: print("atexit ran"))
# Still running when the script ends: the interpreter waits for it.
threading.Thread(target=lambda: (time.sleep(0.5), print("thread ran"))).start()
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(),
                  "env": os.environ.get("ZYGOTE_TEST"),
                  "path0": sys.path[0], "main": __name__,
                  "file": __file__, "argv0": sys.argv[0],
                  "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
if sys.argv[1:] == ["raise"]:
  raise ValueError("boom")
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""


@pytest.mark.parametrize("argv", [["0"], ["3"], ["raise"], ["a b", "--x=1"]])
def test_forked_run_equals_a_fresh_interpreter(tmp_path, argv):
  script = tmp_path / "s.py"
  script.write_text(SCRIPT)
  cwd = tmp_path / "elsewhere"
  cwd.mkdir()
  env = {"ZYGOTE_TEST": "yes", **zygote_client.environ()}
  relative = os.path.join("..", "s.py")  # from another folder, as users do
  fresh = subprocess.run([sys.executable, relative, *argv], cwd=cwd,
                         env=env, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=60)
  forked = zygote_client.run(relative, argv, cwd=str(cwd), env=env,
                             timeout=60)
  assert forked.returncode == fresh.returncode
  assert forked.stdout == fresh.stdout
  assert "thread ran" in forked.stdout and "atexit ran" in forked.stdout
  # Traceback lines name the same file and line (not the zygote's frames).
  fresh_lines = [l for l in fresh.stderr.splitlines() if "runpy" not in l]
  forked_lines = [l for l in forked.stderr.splitlines() if "runpy" not in l]
  assert forked_lines[-1] == fresh_lines[-1]
  assert [l for l in forked_lines if "s.py" in l] == [
      l for l in fresh_lines if "s.py" in l]


def test_a_run_past_its_timeout_is_killed(tmp_path):
  script = tmp_path / "s.py"
  script.write_text("import time\nprint('started', flush=True)\n"
                    "time.sleep(600)\n")
  with pytest.raises(subprocess.TimeoutExpired):
    zygote_client.run(str(script), [], cwd=str(tmp_path),
                      env=zygote_client.environ(), timeout=2)
  # The zygote still serves.
  script.write_text("print('again')\n")
  assert zygote_client.run(str(script), [], cwd=str(tmp_path),
                           env=zygote_client.environ(),
                           timeout=60).stdout == "again\n"


def test_concurrent_runs_signals_and_a_shared_append_log(tmp_path):
  sleeper = tmp_path / "sleep.py"
  sleeper.write_text(
      "import signal, sys, time\n"
      "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
      "print('up', flush=True)\n"
      "print('err', file=sys.stderr, flush=True)\n"
      "for _ in range(6000):\n"  # short sleeps, as in PROXIED below
      "  time.sleep(0.1)\n")
  log = tmp_path / "log"
  log.write_text("before\n")
  env = zygote_client.environ()
  runs = [zygote_client.popen(str(sleeper), [], cwd=tmp_path, env=env,
                              stdout=log, stderr="STDOUT", append=True)
          for _ in range(3)]
  assert len({r.pid for r in runs}) == 3
  with pytest.raises(subprocess.TimeoutExpired):
    runs[0].wait(timeout=0.5)
  assert runs[0].poll() is None
  # Wait until each has installed its handler and written its lines.
  deadline = time.monotonic() + 60
  while log.read_text().count("err") < 3 and time.monotonic() < deadline:
    time.sleep(0.1)
  runs[0].terminate()
  runs[1].kill()
  runs[2].send_signal(15)
  assert [r.wait(timeout=60) for r in runs] == [42, -9, 42]
  text = log.read_text()
  assert text.startswith("before\n")
  assert text.count("up\n") == 3 and text.count("err\n") == 3


def test_a_dead_zygote_is_an_error_not_a_hang(tmp_path):
  # Zygotes of the test's own: the one the other tests use keeps its
  # warm-up (a new one costs ~30 s of CPU).
  outer = zygote_client.python()
  with zygote_client.separate_zygote():
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\nprint('up', flush=True)\n"
                       "time.sleep(600)\n")
    run = zygote_client.popen(str(sleeper), [], cwd=tmp_path,
                              env=zygote_client.environ(),
                              stdout=tmp_path / "out", stderr="STDOUT")
    zygote = zygote_client._zygote  # pylint: disable=protected-access
    zygote.kill()
    try:
      with pytest.raises(RuntimeError, match=r"the test zygote exited "
                         r"\(status -9\) before reporting on"):
        run.wait(timeout=120)
    finally:
      run.kill()
    # The next run starts a new zygote.
    sleeper.write_text("print('again')\n")
    assert zygote_client.run(str(sleeper), [], cwd=str(tmp_path),
                             env=zygote_client.environ(),
                             timeout=120).stdout == "again\n"
    assert zygote_client._zygote is not zygote  # pylint: disable=protected-access
    assert zygote_client.python() != outer
  assert zygote_client.python() == outer
  assert zygote_client._zygote.poll() is None  # pylint: disable=protected-access


PROXIED = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))
print(os.getpid(), "tensorflow" in sys.modules, sys.stdin.read(), flush=True)
if sys.argv[1:] == ["wait"]:
  # Short sleeps: a signal whose handler is due just as a long sleep starts
  # would not end that sleep (Python runs handlers between bytecodes).
  for _ in range(6000):
    time.sleep(0.1)
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""


def _proxied(tmp_path, *argv, env=None, **kwargs):
  script = tmp_path / "p.py"
  script.write_text(PROXIED)
  kwargs.setdefault("stdin", subprocess.PIPE)
  return subprocess.Popen(
      [zygote_client.python(), str(script), *argv], cwd=tmp_path,
      env=dict(zygote_client.environ(), **(env or {})),
      stdout=subprocess.PIPE, text=True, **kwargs)


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


@pytest.mark.parametrize("argv", [["0"], ["3"], ["a b", "--x=1"]])
def test_proxy_python_forks_the_script_from_the_zygote(tmp_path, argv):
  proc = _proxied(tmp_path, *argv)
  out, _ = proc.communicate("stdin text", timeout=120)
  pid, forked, text = out.split()[:3]
  assert (forked, text) == ("True", "stdin")  # TensorFlow was imported
  assert int(pid) != proc.pid
  assert proc.returncode == (3 if argv == ["3"] else 0)


@pytest.mark.parametrize("how", ["python -c", "load-time env", "no zygote"])
def test_proxy_python_runs_a_fresh_interpreter_where_it_must(tmp_path, how):
  if how == "python -c":
    proc = subprocess.run([zygote_client.python(), "-c", "import sys; "
                           "print('tensorflow' in sys.modules); sys.exit(5)"],
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (5, "False\n")
    return
  if how == "no zygote":
    (tmp_path / "p.py").write_text(PROXIED)
    # The same proxy, for a zygote whose socket is gone.
    source = open(zygote_client.python()).read()
    python = tmp_path / "python"
    python.write_text(re.sub(r"'[^']*zygote.sock'", repr(str(tmp_path / "x")),
                             source))
    python.chmod(0o755)
    proc = subprocess.Popen(
        [str(python), str(tmp_path / "p.py")], stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, text=True, env=zygote_client.environ())
  else:
    proc = _proxied(tmp_path, "4", env={"PYTHONHASHSEED": "7"},
                    stdin=subprocess.DEVNULL)
  out, _ = proc.communicate(timeout=120)
  pid, forked = out.split()[:2]
  assert forked == "False" and int(pid) == proc.pid  # exec, not a fork
  assert proc.returncode == (4 if how == "load-time env" else 0)


def test_proxy_python_passes_signals_and_kill_9_on(tmp_path):
  runs = [_proxied(tmp_path, "wait") for _ in range(3)]
  pids = []
  for run in runs:
    run.stdin.close()
    pids.append(int(run.stdout.readline().split()[0]))
  runs[0].terminate()  # forwarded: the script's handler exits 42
  runs[1].kill()  # the run kills itself when its proxy is gone
  runs[2].send_signal(signal.SIGINT)  # forwarded: KeyboardInterrupt
  assert [r.wait(timeout=60) for r in runs] == [42, -9, -2]
  deadline = time.monotonic() + 30
  while any(map(_alive, pids)) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(map(_alive, pids))


WARMED_RUN = """
import atexit, glob, os, runpy, sys, tempfile
root, tests, model_dir = sys.argv[1:]
sys.path[:0] = [root, tests]
from scripts import cli
cli.import_tensorflow_quietly()
import autograph_warmup
from tensorflow.python.autograph.pyct import transpiler
from tensorflow.python.eager import context

# The modules every train.py run needs (the zygote converts more).
warmup = autograph_warmup.Warmup(autograph_warmup.CORE_MODULES)
while warmup.step():
  pass
# Nothing of TensorFlow's runtime started: forking stays safe.
assert not context.context()._initialized
generated = lambda: glob.glob(os.path.join(tempfile.gettempdir(),
                                           "__autograph_generated_file*"))
made = len(generated())
# A forked run runs the exit handlers it inherits: the files stay.
pid = os.fork()
if pid == 0:
  atexit._run_exitfuncs()
  os._exit(0)
os.waitpid(pid, 0)
print("files", made, len(generated()))

# What a forked train.py run then converts itself (AutoGraph's cache misses).
converted = []
convert = transpiler.GenericTranspiler.transform_function
def counting(self, fn, user_context):
  converted.append(f"{fn.__module__}.{fn.__qualname__}")
  return convert(self, fn, user_context)
transpiler.GenericTranspiler.transform_function = counting
sys.argv = [os.path.join(root, "scripts", "train.py"), "--model=mlp",
            "--dataset=synthetic", "--global_batch_size=16",
            "--train_steps=2", "--steps_per_loop=2", "--eval_every=0",
            "--strategy=mirrored", "--cpu_devices=2", f"--model_dir={model_dir}"]
try:
  runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
  assert not e.code, e.code
print("converted", sorted(set(converted)))
"""


def test_autograph_warmup_leaves_a_run_no_framework_function_to_convert(
    tmp_path):
  # The zygote converts the framework's graph code before it forks (see
  # tests/autograph_warmup.py): a run of train.py then converts none of it.
  temp = tmp_path / "tmp"
  temp.mkdir()
  env = {**zygote_client.environ(), "TMPDIR": str(temp)}
  proc = subprocess.run(
      [sys.executable, "-c", WARMED_RUN, helpers.ROOT,
       os.path.join(helpers.ROOT, "tests"), str(tmp_path / "run")],
      env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  [files] = re.findall(r"^files (\d+) (\d+)$", proc.stdout, re.M)
  assert int(files[0]) > 50 and files[0] == files[1], files
  [converted] = re.findall(r"^converted (.*)$", proc.stdout, re.M)
  # Closures (a function's <locals>) are made anew by each call: left to
  # the run (pad_batches.<locals>.pad and a few like it).
  framework_code = [name for name in ast.literal_eval(converted)
                    if name.startswith("framework.") and "<locals>" not in name]
  assert framework_code == [], framework_code
  # At the zygote's own exit, its files go.
  assert not list(temp.glob("__autograph_generated_file*"))
