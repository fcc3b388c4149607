"""Test setup: 2 logical CPU devices for every in-process test.

TensorFlow fixes its devices when it first initialises, so this runs at import
time, before any test module builds a strategy. Tests that need another device
count, or several workers, start subprocesses (see tests/helpers.py).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tensorflow as tf  # pylint: disable=g-import-not-at-top

import framework  # pylint: disable=g-import-not-at-top

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


_SLOW_LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "slow_tests.txt")


def pytest_collection_modifyitems(config, items):
  """Marks `slow` the tests named in tests/slow_tests.txt (measured at 1 s
  or more on an idle 2-core machine), so `-m "not slow"` is the quick
  subset; tests that start several processes carry the mark themselves."""
  del config
  if not os.path.exists(_SLOW_LIST):
    return
  with open(_SLOW_LIST) as f:
    slow = {line.strip() for line in f
            if line.strip() and not line.startswith("#")}
  for item in items:
    if item.nodeid in slow or item.nodeid.split("[")[0] in slow:
      item.add_marker(pytest.mark.slow)
