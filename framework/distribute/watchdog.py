"""A frozen peer is one line, not a hang: the step watchdog.

A task that stops answering (SIGSTOP, a hung NIC, a swapped-out host)
keeps its sockets open, so its peers' collectives would wait for it
forever. What TensorFlow does about it, measured on CPU across processes
with a SIGSTOPped worker (TF 2.21):

- MultiWorkerMirroredStrategy's coordination service: a task without
  heartbeats for `cluster.HEARTBEAT_TIMEOUT` s (5) is reported to every
  other task, whose collectives abort with UnavailableError naming it
  ("stopped sending heartbeats: /job:worker/replica:0/task:1"); a stopped
  leader (chief or worker 0) shows as DeadlineExceededError on the others
  after the same 5 s. Both on 2 and 3 processes.
- `CommunicationOptions(timeout_seconds=T)` aborts a collective after T s
  with DeadlineExceededError ("Collective has timed out during
  execution"), naming no task, but each collective then holds a sleeping
  thread for T s (300 steps at T=600: 600 more threads per process), so a
  long default would exhaust a container's thread limit: not used.
- A model split over a cluster's tasks (`--mesh`, `--model_parallel_devices=
  cluster`) has no coordination service: the chief waited forever.

Either abort is permanent for the process ("Restart your program to
reset"), so the task must exit. This watchdog covers what TensorFlow does
not: a small separate process (the main thread is blocked inside
TensorFlow, holding the GIL) that is told each finished loop; when none
finishes within `timeout` seconds it prints one line naming the tasks
whose servers do not answer and the last step, and SIGKILLs the task
(exit status 137, which `launch.py --max_restarts` restarts):

    with StepWatchdog(tf_config, timeout=600, program="train.py") as dog:
      ...
      dog.progress(step)        # after each loop
"""

import json
import os
import socket
import subprocess
import sys

from framework.distribute.config import check_collective_timeout

# HTTP/2's client preface and an empty SETTINGS frame: a gRPC server that
# runs answers with its own SETTINGS at once; the kernel accepts a stopped
# one's connections, but nothing answers.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\4\0\0\0\0\0"


def answers(address, wait=3.0):
  """Whether the gRPC server at `address` ('host:port') answers within
  `wait` s (False for a refused connection too: a dead task)."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host, int(port)), timeout=wait) as s:
      s.settimeout(wait)
      s.sendall(_HTTP2_HELLO)
      return bool(s.recv(9))
  except OSError:
    return False


def other_tasks(config):
  """[('role:index', address)] of TF_CONFIG dict `config`'s other tasks."""
  task = config["task"]
  me = (task["type"], task.get("index", 0))
  return [(f"{role}:{i}", address)
          for role, addresses in sorted(config["cluster"].items())
          for i, address in enumerate(addresses) if (role, i) != me]


def silent_tasks(config):
  """['role:index'] of the other tasks whose servers do not answer."""
  return [name for name, address in other_tasks(config)
          if not answers(address)]


# Run as `python -c`: the standard library only, no TensorFlow. It reads
# the finished steps from stdin; EOF means the task ended (or exited).
_WATCHDOG_CODE = r"""
import json, os, select, signal, sys
parent, timeout, program, tasks, hello = json.loads(sys.argv[1])
hello = hello.encode("latin-1")
step = None
def answers(address):
  import socket
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host, int(port)), timeout=3) as s:
      s.settimeout(3)
      s.sendall(hello)
      return bool(s.recv(9))
  except OSError:
    return False
def stopped(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
  except OSError:
    return False
buffer = b""
while True:
  ready, _, _ = select.select([sys.stdin], [], [], timeout)
  if not ready:
    break
  data = os.read(sys.stdin.fileno(), 4096)
  if not data:
    sys.exit(0)
  buffer += data
  lines = buffer.split(b"\n")
  buffer = lines.pop()
  if lines:
    step = int(lines[-1])
at = "before its first step" if step is None else f"after step {step}"
if stopped(parent):
  who = f"this task (pid {parent}) is stopped (SIGSTOP?) and did not answer"
else:
  silent = [name for name, address in tasks if not answers(address)]
  who = (" and ".join(silent) + " did not answer" if silent else
         "every task answers, but no step finished")
print(f"{program}: error: {who} within --collective_timeout={timeout:g} s "
      f"{at}; relaunch every task to resume from the latest checkpoint "
      "(launch.py --max_restarts does)", file=sys.stderr, flush=True)
os.kill(parent, signal.SIGKILL)
"""


class StepWatchdog:
  """Kills this task when no loop finishes within `timeout` seconds.

  Args:
    config: the parsed TF_CONFIG (None: the watchdog does nothing).
    timeout: seconds from one finished loop (or from `start`) to the
      next, or to `stop` after the last one, > 0; a healthy loop,
      evaluation or checkpoint never comes near.
    program: the name that starts the error line.
  """

  def __init__(self, config, *, timeout, program="distloop"):
    self.config = config
    self.timeout = check_collective_timeout(timeout)
    self.program = program
    self.last_step = None
    self._process = None
    self._done = False

  def __enter__(self):
    return self.start()

  def start(self):
    """Starts watching (idempotent); returns self."""
    if self.config is not None and self._process is None and not self._done:
      args = json.dumps([os.getpid(), self.timeout, self.program,
                         other_tasks(self.config),
                         _HTTP2_HELLO.decode("latin-1")])
      self._process = subprocess.Popen(
          [sys.executable, "-c", _WATCHDOG_CODE, args],
          stdin=subprocess.PIPE)
    return self

  def progress(self, step, outputs=None):
    """A loop finished at `step` (a Controller train action); the first
    call starts the watchdog if `start` has not."""
    del outputs
    self.last_step = int(step)
    self.start()
    if self._process is not None:
      try:
        self._process.stdin.write(b"%d\n" % self.last_step)
        self._process.stdin.flush()
      except OSError:
        pass  # the watchdog is gone: it has nothing left to do

  def stop(self):
    """Ends the watchdog (the run ended, well or with its own error)."""
    self._done = True
    if self._process is not None:
      try:
        self._process.stdin.close()
      except OSError:
        pass
      self._process.wait()
      self._process = None

  def __exit__(self, *exc):
    self.stop()
