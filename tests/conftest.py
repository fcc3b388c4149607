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
