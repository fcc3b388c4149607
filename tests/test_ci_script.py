""".ci/run runs the README's test command word for word, in a fresh venv."""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_test_command():
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  return re.search(r"Run the tests:\s*```sh\n(.+?)\n```", text,
                   re.S).group(1).strip()


@pytest.mark.slow
def test_ci_runs_the_readme_command_in_a_fresh_venv(tmp_path):
  env = {k: v for k, v in os.environ.items()
         if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
  env.update(DISTLOOP_CI_DRY_RUN="1", TMPDIR=str(tmp_path))
  proc = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run")], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  command = _readme_test_command()
  assert "pip install" in command and "pytest" in command, command
  assert f"): {command}\n" in proc.stdout, proc.stdout
  venv = re.search(r"^venv: True (\S+)$", proc.stdout, re.M)
  assert venv, proc.stdout  # the command's `python` is a venv's
  assert venv.group(1).startswith(str(tmp_path)), venv.group(1)
  assert not os.path.exists(venv.group(1))  # and the venv is gone after
