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
