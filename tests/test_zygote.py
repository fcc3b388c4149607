"""A run forked from the test zygote behaves as `python script.py` would."""

import subprocess
import sys

import pytest

import zygote_client

SCRIPT = """
import json, os, sys, threading, time, atexit
atexit.register(lambda: print("atexit ran"))
# Still running when the script ends: the interpreter waits for it.
threading.Thread(target=lambda: (time.sleep(0.5), print("thread ran"))).start()
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(),
                  "env": os.environ.get("ZYGOTE_TEST"),
                  "path0": sys.path[0], "main": __name__,
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
  fresh = subprocess.run([sys.executable, str(script), *argv], cwd=cwd,
                         env=env, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=60)
  forked = zygote_client.run(str(script), argv, cwd=str(cwd), env=env,
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
      "time.sleep(600)\n")
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
  import time  # pylint: disable=g-import-not-at-top
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
  sleeper = tmp_path / "sleep.py"
  sleeper.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
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
