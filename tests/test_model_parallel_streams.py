"""Device streams (`serial_stages`): one op at a time per stage device."""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import model_parallel as mp
from framework.errors import ConfigError
from framework.model_parallel.devices import DeviceStreams
from tests.helpers import run_script
from tests.model_parallel_reference import (DEVICES, STRATEGY, assert_close,
                                            batches, build, data, skip_model)

BATCH, MICRO = 16, 4


def _pipeline(model, **kwargs):
  return mp.PipelineTrainer(model, keras.optimizers.Adam(1e-2), STRATEGY,
                            num_stages=2, num_microbatches=MICRO,
                            global_batch_size=BATCH, devices=DEVICES,
                            **kwargs)


def _mlp():
  return build("mlp", (12,), 5, hidden_units=(16, 16, 16))


def _graph(trainer, x, y):
  return tf.function(trainer.gradients).get_concrete_function(
      tf.TensorSpec(x.shape, tf.float32), tf.TensorSpec(y.shape,
                                                         tf.int32)).graph


def _all_ancestors(graph):
  """{op: every op it waits for (data or control)}."""
  parents = {op: [t.op for t in op.inputs] + list(op.control_inputs)
             for op in graph.get_operations()}
  ancestors = {}
  # Creation order is not topological once `first` reorders a block: walk
  # the graph depth first.
  for root in graph.get_operations():
    stack = [root]
    while stack:
      op = stack[-1]
      pending = [p for p in parents[op] if p not in ancestors]
      if pending:
        stack.extend(pending)
        continue
      stack.pop()
      if op not in ancestors:
        seen = set(parents[op])
        for parent in parents[op]:
          seen |= ancestors[parent]
        ancestors[op] = seen
  return ancestors


def _unordered_pairs(graph, device_suffix):
  """Pairs of ops on the device that may run at the same time."""
  ancestors = _all_ancestors(graph)
  ops = [op for op in graph.get_operations()
         if op.device.endswith(device_suffix) and
         ("stage_" in op.name)]
  pairs = []
  for i, a in enumerate(ops):
    for b in ops[i + 1:]:
      if a not in ancestors[b] and b not in ancestors[a]:
        pairs.append((a.name, b.name))
  return ops, pairs


def test_serial_stages_orders_every_op_of_a_stage_device():
  x, y = data(BATCH, (12,), 5)
  plain = _pipeline(_mlp())
  ops, pairs = _unordered_pairs(_graph(plain, x, y), "CPU:1")
  # Without streams a layer's input and weight gradients (at least) may
  # run at once.
  assert pairs, "expected concurrent ops without serial_stages"
  serial = _pipeline(_mlp(), serial_stages=True)
  ops, pairs = _unordered_pairs(_graph(serial, x, y), "CPU:1")
  assert len(ops) > 50, len(ops)
  assert any(op.type == "MatMul" and op.name.startswith("gradient_tape")
             for op in ops)
  assert not pairs, pairs[:5]


def test_serial_stages_gives_the_same_gradients_and_training():
  x, y = data(BATCH, (12,), 5)
  for make_model in (_mlp, skip_model):
    if make_model is skip_model:
      x, y = data(BATCH, (6,), 4)
    plain = _pipeline(make_model())
    serial = _pipeline(make_model(), serial_stages=True)
    grads, loss, _ = tf.function(plain.gradients)(x, y)
    serial_grads, serial_loss, _ = tf.function(serial.gradients)(x, y)
    assert_close(serial_loss, loss, "loss", atol=1e-6)
    for i, (a, b) in enumerate(zip(serial_grads, grads)):
      assert float(tf.reduce_max(tf.abs(b))) > 0, f"gradient {i} is zero"
      assert_close(a, b, f"gradient {i}", atol=1e-6)
    # Three steps inside one tf.function loop (the streams live in the
    # loop body's graph).
    losses = [float(t.train(batches(x, y), 3)["loss"]) for t in (plain,
                                                                  serial)]
    np.testing.assert_allclose(losses[1], losses[0], atol=1e-5)


def test_first_chains_the_urgent_ops_ahead_of_the_rest():
  @tf.function
  def block_fn(x):
    streams = DeviceStreams()
    with streams.on("k") as block:
      later = tf.reduce_sum(x * 3.0, name="weight_grad")  # made first
      urgent = tf.identity(x * 2.0, name="input_grad")
      block.first(urgent)
    return later, urgent

  graph = block_fn.get_concrete_function(tf.TensorSpec([2])).graph
  ancestors = _all_ancestors(graph)
  later = graph.get_operation_by_name("weight_grad")
  urgent = graph.get_operation_by_name("input_grad")
  assert later not in ancestors[urgent]
  assert urgent in ancestors[later]


def test_input_grads_first_sends_back_before_the_weight_gradients():
  x, y = data(BATCH, (12,), 5)
  counts = {}
  for first in (True, False):
    trainer = _pipeline(_mlp(), serial_stages=True, input_grads_first=first)
    graph = _graph(trainer, x, y)
    ancestors = _all_ancestors(graph)
    # Stage 1's weight gradients: (units_in, units_out), not micro-batch rows.
    weight_grads = {op for op in graph.get_operations()
                    if op.type == "MatMul" and op.device.endswith("CPU:1")
                    and op.name.startswith("gradient_tape")
                    and op.outputs[0].shape[0] != BATCH // MICRO}
    assert weight_grads
    stage_0_backward = next(
        op for op in graph.get_operations()
        if op.type == "MatMul" and op.device.endswith("CPU:0")
        and op.name.startswith("gradient_tape"))
    counts[first] = len(weight_grads & ancestors[stage_0_backward])
  # Stage 0's first backward matmul waits for none of stage 1's weight
  # gradients with B before W; in creation order it waits for some.
  assert counts[True] == 0 and counts[False] > 0, counts


def test_streams_do_nothing_eagerly_or_when_disabled():
  streams = DeviceStreams()
  with streams.on("/CPU:0"):
    value = tf.constant(1.0) + 1.0  # eager: no graph to chain
  assert float(value) == 2.0

  @tf.function
  def chained(enabled):
    s = DeviceStreams(enabled=enabled)
    with s.on("k"):
      a = tf.constant(1.0) * 2.0
    with s.on("k"):
      b = tf.constant(3.0) * 2.0
    return a + b

  for enabled in (True, False):
    graph = chained.get_concrete_function(enabled).graph
    ops = [op for op in graph.get_operations() if op.type in ("Const", "Mul")]
    assert len(ops) == 6, [op.name for op in ops]  # 2 x (Const, Const, Mul)
    # Enabled: each op after the first waits for the one made before it.
    expected = [[]] + [[before] for before in ops[:-1]] if enabled else (
        [[]] * len(ops))
    assert [list(op.control_inputs) for op in ops] == expected


def test_config_passes_serial_stages_and_needs_a_split():
  with pytest.raises(ConfigError, match="serial_stages orders"):
    mp.ModelParallelConfig(serial_stages=True)
  for mode in ("pipeline", "tensor"):
    config = mp.ModelParallelConfig(mode=mode, serial_stages=True)
    assert config.trainer_factory().keywords["serial_stages"] is True
    assert config.trainer_factory().keywords["input_grads_first"] is True
    config = mp.ModelParallelConfig(mode=mode, serial_stages=True,
                                    input_grads_first=False)
    assert config.trainer_factory().keywords["input_grads_first"] is False


@pytest.mark.slow
def test_train_py_serial_stages_trains_a_pipeline(tmp_path):
  common = ["--model=mlp", "--dataset=synthetic", "--cpu_devices=2",
            "--global_batch_size=32", "--steps_per_loop=2", "--log_every=2",
            "--train_steps=2", "--noexport_saved_model"]
  proc = run_script("train.py", *common, f"--model_dir={tmp_path}/a",
                    "--model_parallel=pipeline", "--num_microbatches=4",
                    "--serial_stages")
  assert "train step 2/2" in proc.stderr
  # GPipe's plain backward order: the same training, other control edges.
  plain = run_script("train.py", *common, f"--model_dir={tmp_path}/c",
                     "--model_parallel=pipeline", "--num_microbatches=4",
                     "--serial_stages", "--noinput_grads_first")
  loss = lambda text: re.search(r"train step 2/2: loss=(\S+)", text).group(1)
  assert loss(plain.stderr) == loss(proc.stderr)
  bad = run_script("train.py", *common, f"--model_dir={tmp_path}/b",
                   "--serial_stages", check=False)
  assert bad.returncode == 1 and "Traceback" not in bad.stderr
  errors = [l for l in bad.stderr.splitlines() if l.startswith("train.py:")]
  assert len(errors) == 1 and "serial_stages orders" in errors[0], errors
  assert not os.path.exists(f"{tmp_path}/b") or not os.listdir(f"{tmp_path}/b")
