"""--log_layer_norms: per-layer norms in TensorBoard, equal to the weights'
own, global under several replicas, and nothing of it when off."""

import os

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
import tensorflow as tf

import framework
from framework import LoopConfig, OptimizerConfig
from framework.core import layer_norms
import helpers

LR = 0.1
CLIP = 0.05  # well below the MLP's gradient norm (about 6): clipping acts
# The MLP's layers' variables, as indices into the checkpoint's list.
LAYER_VARIABLES = ((0, 1), (2, 3))


def run(model_dir, strategy="default", **kwargs):
  """A 2-step plain-SGD MLP run, summaries and a checkpoint every step."""
  kwargs.setdefault("log_layer_norms", True)
  framework.run(helpers.tiny_mlp_config(
      model_dir, strategy=strategy, train_steps=2, clip_norm=CLIP,
      optimizer=OptimizerConfig(name="sgd", learning_rate=LR),
      loop=LoopConfig(train_steps=2, steps_per_loop=2, summary_every=1,
                      checkpoint_every=1, log_every=0), **kwargs))
  return events(model_dir)


def events(model_dir):
  """{tag: {step: value (a scalar, or a histogram's buckets)}} of train/."""
  acc = event_accumulator.EventAccumulator(
      os.path.join(model_dir, "train"),
      size_guidance={event_accumulator.TENSORS: 0})
  acc.Reload()
  return {tag: {e.step: tf.make_ndarray(e.tensor_proto)
                for e in acc.Tensors(tag)}
          for tag in acc.Tags()["tensors"]}


def layers(tags):
  """The MLP's layer paths in the tags, first layer first (Keras numbers
  the layers of each new model on: mlp/dense, mlp/dense_1 or dense_2, ...)."""
  paths = {t.split("/", 1)[1].rpartition("/")[0] for t in tags
           if t.startswith("layer_norms/")}
  number = lambda path: int(path.rpartition("_")[2]) if "_" in path else 0
  return sorted(paths, key=number)


def weights(model_dir, step):
  reader = tf.train.load_checkpoint(os.path.join(model_dir, f"ckpt-{step}"))
  return [reader.get_tensor(
      f"optimizer/_trainable_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE")
          for i in range(4)]


def norm(arrays):
  return np.sqrt(sum(np.sum(np.square(a.astype(np.float64)))
                     for a in arrays))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  model_dir = str(tmp_path_factory.mktemp("one_device"))
  return model_dir, run(model_dir)


def test_values_are_the_norms_of_the_checkpointed_weights(one_device):
  model_dir, tags = one_device
  before, after = weights(model_dir, 1), weights(model_dir, 2)
  grad_squares = 0.0
  assert len(layers(tags)) == len(LAYER_VARIABLES)
  for layer, indices in zip(layers(tags), LAYER_VARIABLES):
    w_before = [before[i] for i in indices]
    update = [after[i] - before[i] for i in indices]
    weight = tags[f"layer_norms/{layer}/weight"][2]
    ratio = tags[f"layer_norms/{layer}/update_ratio"][2]
    grad = tags[f"layer_norms/{layer}/grad"][2]
    np.testing.assert_allclose(weight, norm(w_before), rtol=1e-5)
    np.testing.assert_allclose(ratio, norm(update) / norm(w_before),
                               rtol=1e-3)
    # Plain SGD: the applied gradient is (w_before - w_after) / lr.
    np.testing.assert_allclose(grad, norm(update) / LR, rtol=1e-3)
    grad_squares += float(grad) ** 2
  # The gradient after clipping: its global norm is clip_norm (the
  # unclipped one, logged as grad_norm, is far above it).
  np.testing.assert_allclose(np.sqrt(grad_squares), CLIP, rtol=1e-4)
  assert tags["grad_norm"][2] > 10 * CLIP
  # Every summary step has them; a histogram over the 2 layers per kind.
  for kind in layer_norms.KINDS:
    assert sorted(tags[f"layer_norms/{layers(tags)[0]}/{kind}"]) == [1, 2]
    buckets = tags[f"layer_norms_hist/{kind}"][2]
    assert buckets[:, 2].sum() == len(LAYER_VARIABLES)


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "zero1"])
def test_two_replicas_write_the_global_values(one_device, tmp_path, sharded):
  # ZeRO-1: each replica applies only its reduce-scattered slice of the
  # gradient; the layer's norm is still the whole gradient's.
  _, single = one_device
  mirrored = run(str(tmp_path), strategy="mirrored",
                 shard_optimizer_state=sharded)
  assert len(layers(mirrored)) == len(LAYER_VARIABLES)
  for one, two in zip(layers(single), layers(mirrored)):
    for kind in layer_norms.KINDS:
      values = mirrored[f"layer_norms/{two}/{kind}"]
      assert sorted(values) == [1, 2], (two, kind)
      for step in (1, 2):
        np.testing.assert_allclose(
            values[step], single[f"layer_norms/{one}/{kind}"][step],
            rtol=1e-5, err_msg=f"{kind} of {two} at step {step}")


def test_off_writes_none_and_adds_nothing_to_the_step(tmp_path, monkeypatch):
  def entered(*args, **kwargs):
    raise AssertionError("layer_norms.recorded entered with the flag off")

  monkeypatch.setattr(layer_norms, "recorded", entered)
  tags = run(str(tmp_path), log_layer_norms=False)
  assert "loss" in tags
  assert not [t for t in tags if t.startswith("layer_norms")]


def test_a_whole_step_under_xla_is_one_line(tmp_path):
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  before = helpers.snapshot(str(model_dir))
  proc = helpers.run_script(
      "train.py", "--model=mlp", "--dataset=synthetic", "--train_steps=2",
      f"--model_dir={model_dir}", "--jit_compile", "--log_layer_norms",
      check=False)
  helpers.assert_one_line_error(proc, "train.py", "log_layer_norms=True",
                                "jit_compile", unchanged=before)


def test_no_summary_steps_is_one_clear_error(tmp_path):
  # summary_every=0 records nothing inside the step: the flag would do
  # nothing, silently.
  with pytest.raises(framework.errors.ConfigError,
                     match="log_layer_norms=True.*summary_every=0"):
    helpers.tiny_mlp_config(
        str(tmp_path), log_layer_norms=True,
        loop=LoopConfig(train_steps=2, summary_every=0))
  assert not os.listdir(tmp_path)


def test_two_layers_of_one_name_are_two_layers():
  class Twin(keras.Model):

    def __init__(self):
      super().__init__(name="twin")
      self.first = keras.layers.Dense(3, name="same")
      self.second = keras.layers.Dense(2, name="same")

    def call(self, x):
      return self.second(self.first(x))

  model = Twin()
  model(np.zeros((1, 4), np.float32))
  assert ([v.path for v in model.trainable_variables]
          == ["twin/same/kernel", "twin/same/bias"] * 2)  # what Keras names
  assert layer_norms.group_by_layer(model.trainable_variables) == [
      ("twin/same", [0, 1]), ("twin/same.2", [2, 3])]
