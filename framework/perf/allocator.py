"""The process's memory allocator: as started (glibc's malloc) or tcmalloc.

TensorFlow's CPU kernels allocate and free their tensors with `malloc`.
Under a `tf.distribute` strategy the step runs as a multi-device function
on TensorFlow's own threads, and glibc's malloc serves those threads' large
tensors with fresh `mmap`s that it unmaps again at `free`: every step
page-faults its whole working set back in (a third of a one-core
worker's time in `perf`, seed CNN, 2 MultiWorkerMirrored workers).
tcmalloc keeps freed memory for reuse. The allocator is chosen when the
process starts (`LD_PRELOAD`), so an app that is asked for tcmalloc starts
itself again with it (`reexec_with`), before TensorFlow loads.
"""

import ctypes.util
import os
import sys

from framework.errors import ConfigError

# default: whatever the process was started with (LD_PRELOAD included).
ALLOCATORS = ("default", "tcmalloc")
# What an app's --malloc is unless set.
DEFAULT_ALLOCATOR = ALLOCATORS[0]
# Debian/Ubuntu: apt-get install libtcmalloc-minimal4 (or google-perftools).
_TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")
# Set on the re-executed process, so that a preload that did not take
# is an error instead of a loop.
_REEXEC_MARK = "DISTLOOP_MALLOC_REEXEC"


def find_tcmalloc() -> str | None:
  """The shared library name of tcmalloc on this host, or None."""
  for name in _TCMALLOC_NAMES:
    found = ctypes.util.find_library(name)
    if found:
      return found
  return None


def tcmalloc_loaded() -> bool:
  """Whether tcmalloc serves this process's `malloc`."""
  try:
    with open("/proc/self/maps", encoding="utf-8") as maps:
      mapped = "tcmalloc" in maps.read()
  except OSError:  # Not Linux: only LD_PRELOAD tells.
    mapped = "tcmalloc" in os.environ.get("LD_PRELOAD", "")
  return mapped


def preload_env(allocator: str, env=None) -> dict[str, str]:
  """`env` (default: os.environ) for a process that should use `allocator`.

  Raises:
    ConfigError: `allocator` is unknown, or tcmalloc is not installed.
  """
  _check(allocator)
  env = dict(os.environ if env is None else env)
  if allocator == "default":
    return env
  library = find_tcmalloc()
  if library is None:
    raise ConfigError(
        "malloc='tcmalloc': no tcmalloc library on this host (looked for "
        f"{', '.join('lib' + n for n in _TCMALLOC_NAMES)}); install it "
        "(apt-get install libtcmalloc-minimal4) or use malloc='default'")
  preloads = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
  if library not in preloads:
    env["LD_PRELOAD"] = ":".join([library] + preloads)
  return env


def reexec_with(allocator: str) -> None:
  """Replaces this process by itself with `allocator`, unless it has it.

  Call before TensorFlow loads (it keeps the process id, arguments and
  environment, plus LD_PRELOAD). Returns only when nothing needs to change.

  Raises:
    ConfigError: tcmalloc is missing, or the preload did not take.
  """
  _check(allocator)
  if allocator == "default" or tcmalloc_loaded():
    os.environ.pop(_REEXEC_MARK, None)  # Not for this process's children.
    return
  if os.environ.get(_REEXEC_MARK):
    raise ConfigError(
        f"malloc={allocator!r}: started again with LD_PRELOAD="
        f"{os.environ.get('LD_PRELOAD', '')!r}, tcmalloc is still not loaded")
  env = preload_env(allocator)
  env[_REEXEC_MARK] = "1"
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, list(sys.orig_argv), env)


def _check(allocator):
  if allocator not in ALLOCATORS:
    raise ConfigError(f"malloc={allocator!r} is not one of "
                      f"{', '.join(ALLOCATORS)}")
