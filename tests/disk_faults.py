"""Disk faults for checkpoint tests: a tmpfs (full or read-only), a file
size limit where mounting is not allowed, and filling a filesystem."""

import contextlib
import os
import resource
import signal
import subprocess


@contextlib.contextmanager
def mounted(path, options):
  """A tmpfs at `path` (yields False if mounting is not permitted)."""
  proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs",
                         str(path)], capture_output=True, check=False)
  try:
    yield proc.returncode == 0
  finally:
    if proc.returncode == 0:
      subprocess.run(["umount", str(path)], check=True)


def limit_file_size():
  """A `preexec_fn`: files over 100 kB fail with EFBIG."""
  resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill


def fill(directory, leave_bytes):
  """Fills the filesystem of `directory`, then frees `leave_bytes`."""
  path = os.path.join(directory, "filler")
  fd = os.open(path, os.O_WRONLY | os.O_CREAT)
  for block in (65536, 4096):
    try:
      while True:
        os.write(fd, b"x" * block)
    except OSError:
      pass
  os.close(fd)
  os.truncate(path, max(os.path.getsize(path) - leave_bytes, 0))
