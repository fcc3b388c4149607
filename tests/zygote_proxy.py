"""`python script.py args...` for processes that the tests' processes start
themselves (launch.py's tasks, a benchmark's children, a test's
`subprocess.Popen`), forked from the test zygote instead of a new
interpreter that imports TensorFlow (tests/zygote.py).

The zygote writes an executable `python` that runs this module under the
real interpreter with `-S` (no site-packages: a few milliseconds), and
forked runs see it as `sys.executable`. It hands the zygote the request and
its own stdin, stdout, stderr and one end of a pipe (SCM_RIGHTS), then
stands in for the forked run:

- its exit status is the run's (killed by a signal: it kills itself with
  the same signal);
- a signal it receives (SIGTERM, SIGINT, ...) goes to the run; `kill -9` of
  it closes the pipe, and the run kills itself at once the same way;
- anything the zygote cannot fork for (`-c`, `-m`, options before the
  script, what TensorFlow reads when it loads, no zygote) is `exec` of the
  real interpreter with the same arguments.

The pid a test sees is this process's, not the run's.
"""

import json
import os
import signal
import socket
import sys

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
              signal.SIGUSR1, signal.SIGUSR2)


def main(real, address):
  argv = sys.argv[1:]

  def fresh():
    os.execv(real, [real] + argv)

  if not argv or argv[0].startswith("-") or not argv[0].endswith(".py") or (
      not os.path.isfile(argv[0])):
    fresh()
  try:
    zygote = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    zygote.connect(address)
  except OSError:
    fresh()
  lifeline, keep = os.pipe()
  fds = []
  for fd in (0, 1, 2):
    try:
      os.fstat(fd)
      fds.append(fd)
    except OSError:
      fds.append(os.open(os.devnull, os.O_RDWR))
  request = json.dumps({
      "script": os.path.abspath(argv[0]), "argv": argv[1:],
      "cwd": os.getcwd(), "env": dict(os.environ)}).encode() + b"\n"
  socket.send_fds(zygote, [request], fds + [lifeline])
  os.close(lifeline)
  replies = zygote.makefile("r")
  reply = json.loads(replies.readline() or "{}")
  if "pid" not in reply:  # the zygote says (or, gone, implies): not here
    zygote.close()
    os.close(keep)
    fresh()
  pid = reply["pid"]

  def forward(signum, unused_frame):
    try:
      os.kill(pid, signum)
    except ProcessLookupError:
      pass

  for signum in _FORWARDED:
    signal.signal(signum, forward)
  line = replies.readline()
  if not line:
    sys.stderr.write("zygote_proxy: the test zygote exited before the run "
                     "it forked\n")
    sys.exit(1)
  code = json.loads(line)["returncode"]
  if code < 0:
    sys.stdout.flush()
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
  sys.exit(code)
