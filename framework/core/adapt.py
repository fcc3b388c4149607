"""Preprocessing layers that learn from data (`adapt`), adapted once per run.

keras-io examples start with `layers.Normalization()` adapted on the
training images. A run adapts its model's unadapted ones itself: once,
after the model is built and before the first step of a fresh run, on the
run's own training batches as the layer receives them (through the layers
before it, `models.input_scale`'s times 255 included). The state lives in
the layer's variables, so every checkpoint holds it, and every rebuild (a
resume, `evaluate.py`, `predict.py`, the export, the self-check) restores
it instead of adapting again (`refresh` after a restore).

Only state held in variables is kept: a `Normalization`'s mean and
variance. A lookup's vocabulary (`StringLookup`, `IntegerLookup`,
`TextVectorization`) and `Discretization`'s bin boundaries are no
variables: left unadapted, they are a `ConfigError` naming the layer. A
layer the builder adapted itself, or built with its statistics given, is
left alone.
"""

from typing import Callable, Iterable, List

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from framework import _tf_internal
from framework.errors import ConfigError


class _Reached(Exception):
  """Raised by a layer whose input was recorded: the rest of the model is
  not computed."""


def adaptable_layers(model: keras.Model) -> List[keras.layers.Layer]:
  """The layers of `model` (nested models too) that have `adapt`."""
  if not isinstance(model, keras.layers.Layer):
    return []  # a trainer's own model object: nothing Keras to look into
  return [layer for layer in _tf_internal.flatten_layers(model)
          if isinstance(layer, keras.layers.Layer)
          and not isinstance(layer, keras.Model)
          and callable(getattr(layer, "adapt", None))]


def needs_adapt(layer: keras.layers.Layer) -> bool:
  """Whether `layer` still has to learn its state from data."""
  if isinstance(layer, keras.layers.Normalization):
    if layer.input_mean is not None:
      return False  # its statistics were given
    if not layer.built:
      return True
    # The initial values (mean 0, variance 1): what no data gives.
    return bool(np.all(layer.adapt_mean.numpy() == 0)
                and np.all(layer.adapt_variance.numpy() == 1))
  flag = getattr(layer, "is_adapted", None)
  if isinstance(flag, bool):
    return not flag
  if isinstance(layer, keras.layers.Discretization):
    return layer.bin_boundaries is None
  if callable(getattr(layer, "get_vocabulary", None)):
    return not layer.get_vocabulary(include_special_tokens=False)
  return False


def _check_kept(layer, name):
  if not isinstance(layer, keras.layers.Normalization):
    raise ConfigError(
        f"model={name}: layer {layer.name!r} ({type(layer).__name__}) is "
        "not adapted, and what it would learn is no variable that a "
        "checkpoint keeps (distloop adapts Normalization layers only): "
        "adapt it in the builder, or give it its state (a vocabulary, "
        "bin_boundaries)")


def _features(batch):
  """A training batch's features: the first element of (features, labels)."""
  return batch[0] if isinstance(batch, (tuple, list)) else batch


def _inputs_of(model, layer, chunks):
  """What `layer` receives when `model` is called (inference mode) on each
  of `chunks`, as one float64 array."""
  seen = []

  def record(inputs, *args, **kwargs):
    del args, kwargs
    # float64: a float32 mean of millions of values is off by ~1e-5.
    seen.append(tf.cast(inputs, tf.float64).numpy())
    raise _Reached()

  layer.call = record  # the instance's call, for this pass only
  try:
    for chunk in chunks:
      before = len(seen)
      try:
        model(chunk, training=False)
      except _Reached:
        pass
      if len(seen) == before:
        raise ConfigError(
            f"layer {layer.name!r} ({type(layer).__name__}) is not called "
            "by the model's forward pass: it cannot be adapted on the "
            "inputs it gets; adapt it in the builder")
  finally:
    del layer.call
  return np.concatenate(seen)


def adapt(model: keras.Model, batches: Callable[[], Iterable],
          *, max_examples: int, name: str = "model") -> List[str]:
  """Adapts `model`'s unadapted preprocessing layers; returns their names.

  Args:
    model: the built model (under its strategy's scope, if any).
    batches: `() -> iterable` of training batches (`(features, labels)` or
      features), scaled as the model gets them; called only if a layer
      needs adapting.
    max_examples: at most this many examples are read.
    name: the model's name, for messages.

  Raises:
    ConfigError: an unadapted layer whose state no checkpoint would keep.
  """
  todo = [layer for layer in adaptable_layers(model) if needs_adapt(layer)]
  if not todo:
    return []
  for layer in todo:
    _check_kept(layer, name)
  chunks, count = [], 0
  for batch in batches():
    features = _features(batch)
    take = min(max_examples - count, int(features.shape[0]))
    chunks.append(features[:take])
    count += take
    if count >= max_examples:
      break
  if not chunks:
    raise ConfigError(f"model={name}: no training examples to adapt layer "
                      f"{todo[0].name!r} on")
  # In order: a layer after another one sees the other's adapted output.
  for layer in todo:
    values = _inputs_of(model, layer, chunks)
    layer.adapt(values)
    logging.info("model=%s: adapted %s %r on %d training examples; its "
                 "state is kept in the checkpoints", name,
                 type(layer).__name__, layer.name, len(values))
  return [layer.name for layer in todo]


def refresh(model: keras.Model) -> None:
  """Recomputes what adapted layers derive from their variables, after a
  restore wrote the variables: a `Normalization` reads its mean and
  variance from tensors it made when it was last adapted or loaded."""
  for layer in adaptable_layers(model):
    if (isinstance(layer, keras.layers.Normalization)
        and layer.input_mean is None and layer.built):
      layer.finalize_state()
