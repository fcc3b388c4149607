"""Test setup: 2 logical CPU devices for every in-process test.

TensorFlow fixes its devices when it first initialises, so this runs at import
time, before any test module builds a strategy. Tests that need another device
count, or several workers, start subprocesses (see tests/helpers.py).
"""

import collections
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# distloop's cache (checks done once, framework/data/integrity.py): the
# session's own folder, not the user's ~/.cache.
if not os.environ.get("DISTLOOP_CACHE_DIR"):
  os.environ["DISTLOOP_CACHE_DIR"] = tempfile.mkdtemp(prefix="distloop_cache_")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from scripts import cli  # pylint: disable=g-import-not-at-top

with cli.collection_paused():  # as every script imports it
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

import framework  # pylint: disable=g-import-not-at-top
from framework.perf import allocator  # pylint: disable=g-import-not-at-top


def _tcmalloc_for_child_processes():
  """The processes the tests start (pytest-xdist workers, the zygote and
  every script run) use tcmalloc where it is installed: under glibc's
  malloc a multi-device step maps and unmaps its tensors every step
  (framework/perf/allocator.py); the 2-replica U-Net test spent 44 s of
  its 115 s in the kernel (73 s with tcmalloc). tests/test_allocator.py
  proves both allocators train the same bits. DISTLOOP_TEST_MALLOC=default
  keeps glibc's malloc."""
  choice = os.environ.get("DISTLOOP_TEST_MALLOC", "tcmalloc")
  if choice not in allocator.ALLOCATORS:
    raise SystemExit(f"DISTLOOP_TEST_MALLOC={choice!r} is not one of "
                     f"{', '.join(allocator.ALLOCATORS)}")
  if choice == "tcmalloc" and allocator.find_tcmalloc():
    os.environ.update(allocator.preload_env("tcmalloc"))


_tcmalloc_for_child_processes()

NUM_CPU_DEVICES = 2
framework.configure_cpu_devices(NUM_CPU_DEVICES)
tf.config.experimental.enable_op_determinism()


import pytest  # pylint: disable=g-import-not-at-top,g-bad-import-order
from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top,g-bad-import-order


@pytest.fixture(autouse=True)
def _absl_verbosity(request):
  """Each test starts from the same absl verbosity and leaves it as found.

  Parsing absl flags in-process (config tests, the documented-commands
  harness, a module that parses at import) sets absl's logger to WARNING
  (--verbosity=-1), which hid later tests' INFO lines from `caplog`: a test
  that reads the log sees absl INFO whatever ran before it.
  """
  before = absl_logging.get_verbosity()
  if "caplog" in request.fixturenames:
    absl_logging.set_verbosity(absl_logging.INFO)
  yield
  absl_logging.set_verbosity(before)


def pytest_collection_modifyitems(config, items):
  """Marks `slow` the tests tests/durations.txt measured at 1 s or more (so
  `-m "not slow"` is the quick subset; tests that start several processes
  also carry the mark themselves) and, in a pytest-xdist worker, orders
  whole files longest first so the slowest ones start at once."""
  from tests import durations  # pylint: disable=g-import-not-at-top
  seconds = durations.load()
  for item in items:
    if seconds.get(item.nodeid, 0) >= durations.SLOW_SECONDS:
      item.add_marker(pytest.mark.slow)
  if hasattr(config, "workerinput"):
    per_file = collections.Counter()
    for item in items:
      per_file[item.path] += seconds.get(item.nodeid, 0)
    # Stable: a file's tests keep their order (and share their module
    # fixtures); files of equal time keep theirs.
    items.sort(key=lambda item: -per_file[item.path])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """Under -n, whole test files go to one worker each, in the order the
  workers collected them (longest first): a file's module fixtures (trained
  runs) are built once, and the longest files do not start last. An explicit
  --dist wins."""
  if any(arg.startswith("--dist") or arg == "-d"
         for arg in config.invocation_params.args):
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=g-import-not-at-top
  config.option.loadscopereorder = False  # keep the collected order
  return LoadFileScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
  """`-n auto`: one worker per schedulable core, at most one per 4 GiB of
  memory (a worker, its zygote and a test's cluster of TensorFlow
  processes)."""
  del config
  cores = len(os.sched_getaffinity(0))
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return max(1, min(cores, memory // (4 << 30)))
