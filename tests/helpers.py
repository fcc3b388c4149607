"""Shared test utilities: running the scripts in fresh processes."""

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile

import zygote
import zygote_client

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_mlp_config(model_dir, **kwargs):
  """An `ExperimentConfig` of a 2-step run of a tiny MLP on synthetic data
  (one loop, no summaries, no export); `kwargs` override its fields."""
  # pylint: disable=g-import-not-at-top  (helpers serve processes without TF)
  from framework import ExperimentConfig, LoopConfig
  return ExperimentConfig(**{
      "model": "mlp", "dataset": "synthetic", "model_dir": str(model_dir),
      "global_batch_size": 32, "train_steps": 2, "export_saved_model": False,
      "model_options": dict(hidden_units=(8,)),
      "loop": LoopConfig(train_steps=1, steps_per_loop=2, summary_every=0,
                         log_every=0), **kwargs})


def run_script(script, *args, env=None, timeout=300, check=True, cwd=ROOT,
               fresh=False):
  """Runs `python scripts/<script> args...` in `cwd` (default: the
  repository) in a process of its own; returns the CompletedProcess.

  The process is forked from a zygote that has TensorFlow imported
  (tests/zygote.py) unless `fresh`, or the run changes what TensorFlow reads
  when it loads (see `needs_fresh_interpreter`): then it is a new
  interpreter.
  """
  proc = run_python(os.path.join(ROOT, "scripts", script), *args, env=env,
                    timeout=timeout, cwd=cwd, fresh=fresh)
  if check and proc.returncode != 0:
    raise AssertionError(f"{script} {' '.join(args)} exited "
                         f"{proc.returncode}:\n{proc.stderr[-4000:]}")
  return proc


def run_python(path, *args, env=None, timeout=300, cwd=ROOT, fresh=False):
  """`python path args...` as `run_script` runs it (`path` may be relative
  to `cwd`); returns the CompletedProcess whatever its exit status."""
  full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
  full_env = {k: v for k, v in full_env.items() if v is not None}
  if fresh or needs_fresh_interpreter(args, full_env):
    return subprocess.run(
        [sys.executable, path, *args],
        cwd=cwd, env=full_env, capture_output=True, text=True,
        timeout=timeout)
  return zygote_client.run(path, list(args), cwd=str(cwd), env=full_env,
                           timeout=timeout)


def run_code(code, *args, env=None, timeout=300, cwd=ROOT):
  """`python -c code args...` with the repository first on sys.path, run as
  `run_python` runs a script (so it can fork from the zygote: `-c` cannot);
  returns the CompletedProcess whatever its exit status."""
  with tempfile.TemporaryDirectory(prefix="code_") as folder:
    path = os.path.join(folder, "code.py")
    with open(path, "w") as f:
      f.write(f"import sys\nsys.path.insert(0, {ROOT!r})\n{code}")
    return run_python(path, *args, env=env, timeout=timeout, cwd=cwd)


def run_result(code, *args, timeout=300):
  """`run_code(code, *args)`, which must exit 0 (else its stderr's tail
  fails the test), and the JSON after its last `RESULT ` line."""
  proc = run_code(code, *args, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert lines, proc.stdout[-2000:]
  return json.loads(lines[-1][len("RESULT "):])


def needs_fresh_interpreter(args, env):
  """Whether `python script args` under `env` must be a new interpreter
  rather than a fork of the zygote."""
  if os.environ.get("DISTLOOP_TEST_FRESH_PROCESSES") == "1":
    return True
  return zygote.needs_fresh_interpreter(args, env, zygote_client.environ())


def free_port():
  """A TCP port on 127.0.0.1 that is free right now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Snapshot:
  """Everything under a path: {relative path: (size, sha256) or 'dir'},
  None if the path does not exist. Equal snapshots: byte-for-byte equal
  trees (empty folders included)."""

  def __init__(self, path):
    self.path = str(path)
    self.tree = _tree(self.path)

  def __eq__(self, other):
    return self.path == other.path and self.tree == other.tree

  def __repr__(self):
    return f"Snapshot({self.path!r}, {self.tree})"


def snapshot(path):
  return Snapshot(path)


def _tree(path):
  if not os.path.lexists(path):
    return None
  if not os.path.isdir(path):
    return {".": _file_digest(path)}
  tree = {".": "dir"}
  for folder, dirs, names in os.walk(path):
    for name in dirs:
      tree[os.path.relpath(os.path.join(folder, name), path)] = "dir"
    for name in names:
      full = os.path.join(folder, name)
      tree[os.path.relpath(full, path)] = _file_digest(full)
  return tree


def _file_digest(path):
  with open(path, "rb") as f:
    data = f.read()
  return len(data), hashlib.sha256(data).hexdigest()


# `prog: error: message`, as scripts/cli.py (and absl's usage errors) print.
_ERROR_LINE = re.compile(r"^[\w.-]+: error: ")
# absl's own line for a flag that fails its validator (exit status 1; absl
# adds a "Pass --helpshort ..." hint line).
_FLAG_ERROR_LINE = re.compile(r"^FATAL Flags parsing error: ")
# An exception printed without its traceback ("ValueError: ...").
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*: ")


def assert_one_line_error(proc, script, *fragments, unchanged=None):
  """Checks that `proc` failed the way distloop promises for bad input.

  Exit status 1, no traceback, exactly one `<script>: error: ...` line in
  stderr (or absl's `FATAL Flags parsing error: ...` for a flag its
  validator rejects) and no other error or bare exception line (TensorFlow's own C++
  log lines, `E0000 ... error ...`, are not ours and are ignored), the line
  containing every one of `fragments`; and, with `unchanged` (a `snapshot`
  taken before the run), that path exactly as it was: nothing written,
  removed or touched.

  Returns:
    The error line.
  """
  stderr = proc.stderr
  tail = stderr[-3000:]
  assert proc.returncode == 1, f"exit status {proc.returncode}:\n{tail}"
  assert "Traceback" not in stderr, tail
  errors = [l for l in stderr.splitlines()
            if _ERROR_LINE.match(l) or _FLAG_ERROR_LINE.match(l)]
  assert len(errors) == 1, f"{len(errors)} error lines:\n{tail}"
  line = errors[0]
  prefix = (_FLAG_ERROR_LINE.match(line) or
            re.match(re.escape(f"{script}: error: "), line))
  assert prefix, f"not a {script} error line: {line!r}"
  assert line[prefix.end():].strip(), "empty message"
  exceptions = [l for l in stderr.splitlines() if _EXCEPTION_LINE.match(l)]
  assert not exceptions, f"bare exception lines {exceptions}:\n{tail}"
  for fragment in fragments:
    assert fragment in line, f"{fragment!r} not in {line!r}"
  if unchanged is not None:
    after = snapshot(unchanged.path)
    assert after == unchanged, f"changed: {unchanged} -> {after}"
  return line


def final_eval(stderr):
  """{metric: value} of train.py's `final eval: {...}` log line."""
  import ast  # pylint: disable=g-import-not-at-top
  return ast.literal_eval(re.search(r"final eval: (\{.*\})", stderr).group(1))


def printed_metrics(stdout):
  """{metric: value} of evaluate.py's printed metric lines."""
  return {k: float(v) for k, v in re.findall(r"^  (\w+)\s+([\d.]+)$", stdout,
                                             re.M)}
