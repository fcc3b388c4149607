"""`jit_compile` and `shard_optimizer_state` together: the XLA-compiled
sharded update gives the unsharded, uncompiled run's weights."""

import pytest

from test_trainer import data, make_trainer, max_diff, train  # pylint: disable=unused-import


@pytest.mark.parametrize("optimizer,learning_rate",
                         [("momentum", 0.05), ("adam", 1e-3)])
def test_jit_compiled_sharded_update_equals_the_plain_one(
    data, optimizer, learning_rate):
  plain = make_trainer("mirrored", optimizer=optimizer,
                       learning_rate=learning_rate)
  both = make_trainer("mirrored", optimizer=optimizer,
                      learning_rate=learning_rate,
                      shard_optimizer_state=True, jit_compile=True)
  assert both.optimizer_sharding is not None and both.jit_compile
  (plain_weights, plain_metrics), (weights, metrics) = [
      train(t, data, steps=6) for t in (plain, both)]
  # XLA fuses differently: equal to float32 rounding, not bit for bit.
  assert max_diff(plain_weights, weights) < 1e-5
  assert metrics["loss"] == pytest.approx(plain_metrics["loss"], abs=1e-5)
