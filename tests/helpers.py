"""Shared test utilities: running the scripts in fresh processes."""

import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script, *args, env=None, timeout=300, check=True):
  """Runs `python scripts/<script> args...`; returns the CompletedProcess."""
  full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
  full_env = {k: v for k, v in full_env.items() if v is not None}
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", script), *args],
      cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
  if check and proc.returncode != 0:
    raise AssertionError(f"{script} {' '.join(args)} exited "
                         f"{proc.returncode}:\n{proc.stderr[-4000:]}")
  return proc


def free_port():
  """A TCP port on 127.0.0.1 that is free right now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
