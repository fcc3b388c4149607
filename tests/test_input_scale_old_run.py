"""A run folder written before the input-scale wrapper existed (its
model_info.json has no `input_times_255`) resumes and is evaluated with the
inputs it was trained on: its Rescaling(1/255)-first model gets no x255."""

import json

import keras
import numpy as np
import pytest

import framework
import framework.errors
from framework.app import experiment, export
from models import input_scale


# model_info.json's record of the decision (a file layout: spelled out).
RECORD = "input_times_255"


def wrapped(model):
  return input_scale.WRAPPER_LAYER in [l.name for l in model.layers]


def rescaling_first(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = keras.layers.Rescaling(1 / 255)(inputs)
  x = keras.layers.Flatten()(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def _config(model_dir, steps):
  return framework.ExperimentConfig(
      dataset="synthetic", model_dir=str(model_dir), global_batch_size=32,
      train_steps=steps, export_saved_model=False,
      loop=framework.LoopConfig(train_steps=steps, steps_per_loop=2,
                                summary_every=0, log_every=0))


def test_an_old_run_resumes_as_it_was_trained(tmp_path, monkeypatch):
  # The old code: no wrapper, and no record of it.
  with monkeypatch.context() as patch:
    patch.setattr(input_scale, "give_pixels",
                  lambda model, *args, **kwargs: model)
    experiment.run(_config(tmp_path, 2), build_model=rescaling_first)
  info_path = tmp_path / export.MODEL_INFO_FILE
  info = json.loads(info_path.read_text())
  info.pop(RECORD, None)
  info_path.write_text(json.dumps(info))
  old_info = dict(info)

  # Resumed by today's code: not refused, and no x255 in front.
  seen = {}
  experiment.run(_config(tmp_path, 4), build_model=rescaling_first,
                 prepare_controller=lambda c: seen.update(
                     model=c.trainer.model, step=c.step))
  assert seen["step"] == 2
  assert not wrapped(seen["model"])
  info = json.loads(info_path.read_text())
  assert info[RECORD] is False
  # evaluate.py / predict.py build it the same, with or without the
  # record: its weights load and the [0, 1] inputs reach Rescaling(1/255)
  # as in training.
  for record in (old_info, info):
    rebuilt = export.build_inference_model(record, trust_model_code=True)
    assert not wrapped(rebuilt)
    rebuilt.load_weights(str(tmp_path / export.WEIGHTS_FILE))
    for got, want in zip(rebuilt.weights, seen["model"].weights):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_run_wrapped_before_the_record_keeps_its_times_255(tmp_path):
  # The code between the wrapper and its record: wrapped, nothing recorded.
  experiment.run(_config(tmp_path, 2), build_model=rescaling_first)
  info_path = tmp_path / export.MODEL_INFO_FILE
  info = json.loads(info_path.read_text())
  assert info.pop(RECORD) is True
  info_path.write_text(json.dumps(info))

  # evaluate.py / predict.py: the checkpoints' fingerprint says wrapped.
  rebuilt = export.build_inference_model(
      export.read_model_info(str(tmp_path)), trust_model_code=True)
  assert wrapped(rebuilt)
  # A resume cannot tell: it is refused (one line), never trained on
  # inputs of another scale.
  with pytest.raises(framework.errors.CheckpointError,
                     match="model_fingerprint"):
    experiment.run(_config(tmp_path, 4), build_model=rescaling_first)
