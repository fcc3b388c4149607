"""A mesh's copies follow copy 0 at the start of every `train` while
moving nothing when nothing changed it: on `data:2,pipeline:2`, unsharded
and with ZeRO-3, the sync (and ZeRO-3's cut of copy 0 into the shards)
runs no assignment after an uninterrupted train, while a user's
set_weights, an assignment to a slot and a checkpoint restore between
train calls (what a rollback does) reach every copy: after the next train
the copies equal copy 0, and ZeRO-3 ends with the unsharded run's weights.

The 4-device mesh runs in one fresh process (`copies_sync_reference`).
"""

import numpy as np
import pytest

from tests import helpers

_MESH = """
import json
import framework
framework.configure_cpu_devices(4)
from tests import copies_sync_reference as ref
print("RESULT " + json.dumps(ref.run()))
"""


@pytest.fixture(scope="module")
def mesh():
  return helpers.run_result(_MESH, timeout=900)


def test_nothing_moves_when_nothing_changed_copy_0(mesh):
  assert mesh["idle"] == {
      "plain": {"sync": {"bytes": 0, "assigns": 0}},
      "zero3": {"sync": {"bytes": 0, "assigns": 0},
                "load": {"bytes": 0, "assigns": 0}}}


@pytest.mark.parametrize("change", ["set_weights", "slot", "restored"])
def test_a_change_of_copy_0_between_train_calls_reaches_every_copy(
    mesh, change):
  assert mesh[change] and all(v == 0.0 for v in mesh[change].values())


def test_zero3_cuts_a_changed_copy_0_into_its_shards(mesh):
  # Both set from the same weights and restored from their own step-2
  # checkpoint: ZeRO-3 trains what the unsharded mesh trains.
  plain, zero3 = mesh["weights"]["plain"], mesh["weights"]["zero3"]
  assert len(plain) == len(zero3)
  for a, b in zip(plain, zero3):
    np.testing.assert_allclose(np.array(b), np.array(a), rtol=0, atol=1e-6)
