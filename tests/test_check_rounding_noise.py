"""The self-check names rounding, not "no recognised pattern", when a
difference is within 10x the model's measured rounding noise but above the
5% cap (the full-size U-Net: 18 BatchNorm layers amplify float32 rounding
to ~5% in its deepest levels). A real error (a factor) still fails."""

import numpy as np
import pytest

from framework.check import distribution_diagnosis as diagnosis
from framework.check import distribution_diagnosis as differences


def _outcome(delta):
  return differences.Outcome(names=["unet/conv2d_8/kernel"],
                             trainable=[True], deltas=[delta], spreads=[0.0],
                             opt_names=[], opt_deltas=[], metrics={})


def _compare(dist_rel, noise_rel=0.006):
  rng = np.random.default_rng(0)
  ref = rng.normal(size=1000)
  direction = rng.normal(size=1000)
  direction *= np.linalg.norm(ref) / np.linalg.norm(direction)
  noise = _outcome(ref + noise_rel * direction)
  dist = _outcome(ref + dist_rel * rng.permutation(direction))
  return diagnosis.compare(dist, _outcome(ref), noise, 2, 1e-3, 1e-9, [],
                           None, True)


def test_a_difference_within_ten_times_the_noise_is_rounding():
  rows, causes = _compare(0.055)  # above the 0.05 cap, below 10 x 0.006
  [row] = [r for r in rows if r.section == "update"]
  assert not row.ok and row.tolerance == differences.MAX_TOLERANCE
  assert [c.code for c in causes] == ["rounding_noise"]
  assert "rounding noise (0.006" in causes[0].message
  assert "conv2d_8" in causes[0].message
  assert "rounding_noise" in diagnosis.WARNING_CAUSES


@pytest.mark.parametrize("dist_rel", [0.07, 0.5])
def test_beyond_the_noise_is_still_a_failure(dist_rel):
  _, causes = _compare(dist_rel)
  assert [c.code for c in causes] == ["update_mismatch"]


def test_within_the_cap_passes():
  rows, causes = _compare(0.03)
  assert causes == [] and all(r.ok for r in rows)
