"""Custom inputs given to `experiment.run`: the shape a run trains on, and
what its `model_info.json` says about its data.

`experiment.run(config, train_input=..., eval_input=...)` trains on a user's
own pipelines; `config.dataset` still gives the number of classes, the class
names and (without `train_input`) the epoch length. Two things follow:

- The model is built for the features `train_input` really gives (a plain
  `tf.data.Dataset` tells its shape), not for `config.dataset`'s, and
  `model_info.json` records that shape.
- `evaluate.py` and `predict.py --index` cannot rebuild a user's pipeline, so
  a run whose evaluation data was custom records so (`"eval_input":
  "custom"`), and they refuse it in one line unless they are told which data
  to read (`--dataset`, `--data_dir`), instead of scoring the run on
  `config.dataset`'s test split, which is other data.

Your own arrays need no custom input at all: `dataset="numpy"` with
`data_dir=` an `.npz` file is a dataset like the others, and a run on it is
evaluated on its own test split by the scripts.
"""

from absl import logging
import tensorflow as tf

from framework.data.inputs import MaskedBatch
from framework.errors import ConfigError

CUSTOM = "custom"
DATASET = "dataset"


def features_shape(data):
  """The per-example shape of `data`'s features (a plain `tf.data.Dataset`
  of `(features, labels)` batches), or None where it cannot tell (another
  kind of input, a dynamic shape, nested features)."""
  if not isinstance(data, tf.data.Dataset):
    return None
  spec = data.element_spec
  if isinstance(spec, MaskedBatch):
    spec = spec.batch
  if isinstance(spec, tuple) and len(spec) >= 2:
    spec = spec[0]
  if not isinstance(spec, tf.TensorSpec) or spec.shape.rank in (None, 0):
    return None
  shape = tuple(spec.shape[1:])
  return None if any(d is None for d in shape) else shape


class _WithInputShape:
  """`dataset` with another `input_shape` (everything else its own)."""

  def __init__(self, dataset, input_shape):
    self._dataset = dataset
    self.input_shape = tuple(input_shape)

  def __getattr__(self, name):
    return getattr(self._dataset, name)


def fit_dataset(dataset, dataset_name, train_input, eval_input):
  """`dataset`, with the input shape `train_input(0)` gives if that differs.

  Raises ConfigError when the shapes differ and there is no `eval_input`:
  the run would evaluate on `dataset`'s test split, of the other shape.
  """
  if train_input is None:
    return dataset
  shape = features_shape(train_input(0))
  if shape is None or shape == tuple(dataset.input_shape):
    return dataset
  if eval_input is None:
    raise ConfigError(
        f"train_input gives features of shape {shape}, but "
        f"dataset={dataset_name} has {tuple(dataset.input_shape)} and, with "
        "no eval_input, the run would evaluate on its test split: pass "
        "eval_input= too, or put your arrays in an .npz and use "
        "dataset='numpy', data_dir=<file> (no custom inputs needed)")
  logging.info("train_input gives features of shape %s: the model is built "
               "for it (dataset=%s has %s)", shape, dataset_name,
               tuple(dataset.input_shape))
  return _WithInputShape(dataset, shape)


def record(train_input, eval_input):
  """model_info.json's fields on where the run's data came from."""
  return {"train_input": CUSTOM if train_input is not None else DATASET,
          "eval_input": CUSTOM if eval_input is not None else DATASET}


def check_own_data(info, dataset, data_dir, *, what="evaluate it",
                   how="say which data to read with --dataset and "
                   "--data_dir (e.g. --dataset=numpy --data_dir=data.npz)"):
  """Raises ConfigError if `info`'s run evaluated on custom inputs and
  neither `dataset` nor `data_dir` says which data to read instead."""
  if info.get("eval_input") != CUSTOM or dataset or data_dir:
    return
  raise ConfigError(
      "this run evaluated on a custom eval_input (given to experiment.run), "
      f"which its model_info.json cannot rebuild; to {what} on "
      f"dataset={info.get('dataset')} (which only gave its classes) would "
      f"use other data: {how}")
