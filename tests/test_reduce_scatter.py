"""The reduce-scatter (an all-to-all and a local sum) on CPU: equal to the
all-reduce's rows on 2 logical devices and across 2 processes, and what
ZeRO-1's default step reduces its gradients with."""

import re

import numpy as np
import pytest
import tensorflow as tf

import framework
import helpers
from framework.distribute import collectives
from test_trainer import data, make_trainer, max_diff, train  # pylint: disable=unused-import


def test_equals_the_all_reduce_rows_on_two_logical_devices():
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  scatter = collectives.ReduceScatter(strategy)
  widths = (1, 5, 333)

  @tf.function
  def step(seed):
    def replica_fn():
      r = tf.distribute.get_replica_context().replica_id_in_sync_group
      values = [tf.random.stateless_normal([2, w], seed=[seed, 10 * r + i])
                for i, w in enumerate(widths)]
      values.append(tf.cast(values[0] * 3., tf.bfloat16))
      return scatter(values[:-1]) + [scatter(values[-1])], values
    return strategy.run(replica_fn)

  # No strategy all-reduce to compare with: every MirroredStrategy of a
  # process numbers its collectives alike, and another test's would clash.
  local = lambda x: [np.asarray(tf.cast(t, tf.float64))
                     for t in strategy.experimental_local_results(x)]
  for seed in (11, 12):  # a second call: fresh instance keys
    mine, values = step(seed)
    for a, v in zip(mine, values):
      total = sum(local(v))  # [2, w]: row r is replica r's slice
      got = np.stack(local(a))
      assert got.shape == total.shape
      assert np.abs(got).max() > 0.1
      assert np.abs(got - total).max() <= (1e-6 if a is not mine[-1]
                                           else 0.1)

def test_zero1_step_reduce_scatters_unless_the_all_reduce_is_configured(
    data, monkeypatch):
  calls = []
  original = collectives.ReduceScatter.__call__

  def counted(self, chunks):
    calls.append(len(chunks))
    return original(self, chunks)

  monkeypatch.setattr(collectives.ReduceScatter, "__call__", counted)
  weights = {}
  for name, kwargs in [
      ("scatter", {}),
      ("configured", {"all_reduce": framework.AllReduceConfig(
          bytes_per_pack=1 << 30)}),
      ("unsharded", {"shard_optimizer_state": False})]:
    calls.clear()
    trainer = make_trainer("mirrored", optimizer="adam", learning_rate=2e-3,
                           clip_norm=0.1,
                           **{"shard_optimizer_state": True, **kwargs})
    weights[name], _ = train(trainer, data, steps=4)
    # One call per replica per trace, all 4 variables (one dtype) in it.
    assert calls == ([4, 4] if name == "scatter" else []), name
  assert max_diff(weights["scatter"], weights["unsharded"]) <= 1e-6
  assert max_diff(weights["configured"], weights["unsharded"]) <= 1e-6


@pytest.mark.slow
def test_equals_the_all_reduce_across_two_processes():
  proc = helpers.run_python("scripts/benchmarks/reduce_scatter.py", "--check",
                            timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  found = re.findall(r"max \|diff\| (\S+) \(exit 0\)", proc.stdout)
  assert len(found) == 2, proc.stdout
  assert all(float(d) <= 1e-7 for d in found)
  assert "mirrored, 2 logical CPU devices: max |diff|" in proc.stdout


def test_the_reduce_scatter_is_timed_as_the_collective_wait(data):
  # Each worker's step time is split with collective_wait_seconds (set
  # where the replicas span workers); ZeRO-1's reduce-scatter, which takes
  # the all-reduce's place, adds to it as the all-reduce did.
  trainer = make_trainer("mirrored", shard_optimizer_state=True)
  with tf.device("CPU:0"):
    trainer.collective_wait_seconds = tf.Variable(
        0.0, dtype=tf.float64, trainable=False)
  train(trainer, data, steps=2)
  assert float(trainer.collective_wait_seconds.numpy()) > 0
