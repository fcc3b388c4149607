"""Models that rescale their own input get the pixels they expect.

distloop's input pipeline divides uint8 images by 255
(`framework/data/preprocessing.py`), so a model whose first layer divides by
255 again (`Rescaling(1/255)`, as in keras-io's examples and in
`keras.applications` EfficientNet) or normalises with statistics of 0-255
pixels (a `Normalization` adapted on raw images) would see inputs 255 times
too small and train at chance without a word. `build_model` hands such a
model 0-255 pixels instead: it puts `Rescaling(255)` in front of it and logs
one line naming the layer. Every process that builds the model (training,
evaluate.py, predict.py, the export) does the same, so the checkpoint fits.
"""

from absl import logging
import numpy as np

# A leading Rescaling whose scale is below this maps 0-255 to about [0, 2]:
# 1/255 and 1/127.5 (to [-1, 1] with offset -1) are the usual ones.
_PIXEL_SCALE = 1 / 100
# A leading Normalization whose mean is above this was adapted on 0-255.
_PIXEL_MEAN = 2.0
WRAPPER_LAYER = "pixels_0_255"


def _first_layer(model):
  """The first layer after the inputs (looking into a nested model)."""
  import keras  # pylint: disable=g-import-not-at-top
  for layer in getattr(model, "layers", ()):
    if isinstance(layer, keras.layers.InputLayer):
      continue
    if isinstance(layer, keras.Model):
      return _first_layer(layer)
    return layer
  return None


def expects_pixels(model):
  """The model's leading layer that expects 0-255 pixels, or None."""
  import keras  # pylint: disable=g-import-not-at-top
  layer = _first_layer(model)
  if isinstance(layer, keras.layers.Rescaling):
    scale = np.abs(np.asarray(layer.scale, dtype=np.float64))
    if scale.size and 0 < float(np.max(scale)) < _PIXEL_SCALE:
      return layer
  if isinstance(layer, keras.layers.Normalization):
    mean = getattr(layer, "mean", None)
    if mean is not None and float(np.max(np.asarray(mean))) > _PIXEL_MEAN:
      return layer
  return None


def describe(layer):
  """'Rescaling rescaling (scale=0.003922)' for the log line."""
  if hasattr(layer, "scale"):
    what = f"scale={float(np.max(np.asarray(layer.scale))):.6g}"
  else:
    what = f"mean up to {float(np.max(np.asarray(layer.mean))):.4g}"
  return f"{type(layer).__name__} {layer.name!r} ({what})"


def give_pixels(model, name):
  """`model`, or a model that multiplies its input by 255 and calls
  `model`, when `model`'s first layer expects 0-255 pixels (logged)."""
  layer = expects_pixels(model)
  if layer is None:
    return model
  try:
    shape = model.input_shape
  except (AttributeError, ValueError):
    return model
  if not isinstance(shape, tuple) or not shape or not isinstance(
      shape[0], (int, type(None))):
    return model  # several inputs: not images of the contract
  import keras  # pylint: disable=g-import-not-at-top
  inputs = keras.Input(shape[1:], name="pixels")
  x = keras.layers.Rescaling(255.0, name=WRAPPER_LAYER)(inputs)
  logging.info(
      "model=%s starts with %s, which expects 0-255 pixels; the input "
      "pipeline gives [0, 1] (uint8/255), so the model gets its input "
      "times 255 (layer %s)", name, describe(layer), WRAPPER_LAYER)
  return keras.Model(inputs, model(x), name=model.name)
