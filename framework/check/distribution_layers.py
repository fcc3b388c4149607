"""The layers the distribution check switches for its duration, and why.

Dropout and Keras's noise layers draw different numbers on each device,
and an unsynchronised BatchNorm normalises each replica's part of the batch
with its own statistics: expected differences, not bugs. The check switches
them (dropout and noise off, BatchNorm synchronised), compares the rest
exactly, names each in a warning, and puts them back afterwards.
"""

import keras

from framework import _tf_internal
from framework.check.distribution_diagnosis import Finding

# Keras layers that only add noise in training, and the attribute that turns
# the noise off when 0 (their `call` then draws nothing).
NOISE_LAYERS = ((keras.layers.GaussianNoise, "stddev"),
                (keras.layers.GaussianDropout, "rate"),
                (keras.layers.AlphaDropout, "rate"))


def prepare_model(model):
  """Dropout and noise off, BatchNorm synchronised.

  Returns:
    (undo, dropouts, unsynchronised BatchNorms, noise layers): `undo` is
    [(layer, attribute, value)] to put back; the rest layer names.
  """
  undo, dropouts, unsynced, noisy = [], [], [], []
  for layer in _tf_internal.flatten_layers(model):
    if isinstance(layer, keras.layers.Dropout) and layer.rate > 0:
      dropouts.append(layer.name)
      undo.append((layer, "rate", layer.rate))
      layer.rate = 0.0
    for cls, attr in NOISE_LAYERS:
      if isinstance(layer, cls) and getattr(layer, attr) > 0:
        noisy.append(layer.name)
        undo.append((layer, attr, getattr(layer, attr)))
        setattr(layer, attr, 0.0)
    if (isinstance(layer, keras.layers.BatchNormalization) and
        not layer.synchronized):
      unsynced.append(layer.name)
      undo.append((layer, "synchronized", False))
      layer.synchronized = True
  return undo, dropouts, unsynced, noisy


def put_back(undo):
  """Undoes `prepare_model`."""
  for layer, attr, value in undo:
    setattr(layer, attr, value)


def random_layers(model):
  """Layers other than dropout and noise that draw random numbers."""
  switched_off = (keras.layers.Dropout,) + tuple(c for c, _ in NOISE_LAYERS)
  return [l.name for l in _tf_internal.flatten_layers(model)
          if _tf_internal.has_seed_generator(l)
          and not isinstance(l, switched_off)]


def layer_warnings(model, replicas, dropouts, unsynced, noisy):
  """The warnings about what `prepare_model` switched, and random layers."""
  warnings = []
  if unsynced and replicas > 1:
    warnings.append(Finding(
        "batch_norm_unsynchronized",
        f"BatchNormalization without synchronisation ({', '.join(unsynced)}):"
        f" each of the {replicas} replicas normalises with the statistics of "
        "its own part of the batch, so training differs from one device "
        "(the check synchronised them to compare the rest); use "
        "synchronized=True (--sync_batch_norm)"))
  if dropouts:
    warnings.append(Finding(
        "dropout",
        f"dropout ({', '.join(dropouts)}) draws different masks per device; "
        "the check ran with dropout off, so it is not covered"))
  randoms = random_layers(model)
  if noisy or randoms:
    handled = ([f"{', '.join(noisy)} switched off"] if noisy else []) + (
        [f"{', '.join(randoms)} drawing their mean"] if randoms else [])
    warnings.append(Finding(
        "random_layers",
        f"layers drawing random numbers ({'; '.join(handled)}) would draw "
        "different numbers on each device; the check compared the rest "
        "without their noise, so the noise itself is not covered"))
  return warnings
