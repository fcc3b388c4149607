"""`model_parallel.fingerprints`: the fingerprint of a tensor's bits is
the documented sum (a numpy reference), the same chunked or not, and
tells apart any two tensors whose 16-bit limbs differ in one or two
positions (-0.0 and 0.0 too)."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from framework.model_parallel import fingerprints

P = 2**31 - 1


def _reference(array):
  array = np.ascontiguousarray(array).reshape(-1)
  if array.dtype == np.bool_:
    array = array.astype(np.uint8)
  view = np.uint8 if array.dtype.itemsize == 1 else np.uint16
  limbs = array.view(view).astype(object)  # Python integers: exact
  positions = np.arange(1, limbs.size + 1, dtype=object)
  return [int(np.sum(positions * limbs) % P),
          int(np.sum(positions * positions % P * limbs) % P)]


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int64",
                                   "int32", "uint8", "bool"])
def test_the_fingerprint_is_the_documented_sum(dtype):
  rng = np.random.default_rng(3)
  array = (rng.normal(size=(7, 5)) * 1000).astype(dtype)
  assert fingerprints.fingerprint(array).numpy().tolist() == _reference(array)


def test_chunked_equals_whole():
  array = np.random.default_rng(4).normal(size=(37, 3)).astype(np.float32)
  whole = fingerprints.fingerprint(array).numpy().tolist()
  assert whole == _reference(array)
  for chunk in (1, 5, 64, 222):  # 222 limbs: one chunk exactly
    got = tf.function(lambda x, c=chunk: fingerprints.fingerprint(x, c))(
        tf.constant(array))
    assert got.numpy().tolist() == whole, chunk


def test_one_or_two_changed_limbs_always_differ():
  base = np.random.default_rng(5).integers(0, 2**16, size=24, dtype=np.uint16)
  before = fingerprints.fingerprint(base).numpy().tolist()
  for i, j in itertools.combinations(range(base.size), 2):
    for a, b in ((1, -1), (7, 0), (-3, 2)):
      changed = base.astype(np.int64)
      changed[i] = (changed[i] + a) % 2**16
      changed[j] = (changed[j] + b) % 2**16
      got = fingerprints.fingerprint(changed.astype(np.uint16)).numpy()
      assert got.tolist() != before, (i, j, a, b)
  assert fingerprints.differs(
      fingerprints.fingerprint(np.float32([0.0, 1.0])),
      fingerprints.fingerprint(np.float32([-0.0, 1.0]))).numpy()
