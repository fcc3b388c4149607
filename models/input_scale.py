"""Models that rescale their own input get the pixels they expect.

distloop's input pipeline divides uint8 images by 255
(`framework/data/preprocessing.py`), so a model whose first layer divides by
255 again (`Rescaling(1/255)`, as in keras-io's examples and in
`keras.applications` EfficientNet) or normalises with statistics of 0-255
pixels (a `Normalization` adapted on raw images) would see inputs 255 times
too small and train at chance without a word. `build_model` hands such a
model 0-255 pixels instead: it puts `Rescaling(255)` in front of it and logs
one line naming the layer. The scaling layer is looked for before the first
layer with weights, inside nested models too (keras-io's augmentation
`Sequential` first, `Rescaling(1/255)` second).

Only the data decides (`scaled_pixels`): uint8 images that the pipeline divided by
255 are multiplied back; float features and tokens reach the model as they
are, whatever its first layer. The decision is recorded in model_info.json
(`RECORD`) so that every process that rebuilds the model (a resume,
evaluate.py, predict.py, the export) builds the same; a run folder without
the record was written before the wrapper existed and gets none.
"""

from absl import logging
import numpy as np

# A leading Rescaling whose scale is below this maps 0-255 to about [0, 2]:
# 1/255 and 1/127.5 (to [-1, 1] with offset -1) are the usual ones.
_PIXEL_SCALE = 1 / 100
# A leading Normalization whose mean is above this was adapted on 0-255.
_PIXEL_MEAN = 2.0
WRAPPER_LAYER = "pixels_0_255"
# model_info.json's key: whether the model was built with `WRAPPER_LAYER`
# in front (absent: a run from before it, built without).
RECORD = "input_times_255"

_STOP = object()  # a layer with weights (or another scaling) came first


def _scaling_layer(layer):
  """`layer` if it is a Rescaling or Normalization that expects 0-255
  pixels, _STOP if it is another kind of scaling, else None."""
  import keras  # pylint: disable=g-import-not-at-top
  if isinstance(layer, keras.layers.Rescaling):
    scale = np.abs(np.asarray(layer.scale, dtype=np.float64))
    if scale.size and 0 < float(np.max(scale)) < _PIXEL_SCALE:
      return layer
    return _STOP
  if isinstance(layer, keras.layers.Normalization):
    mean = getattr(layer, "mean", None)
    if mean is not None and float(np.max(np.asarray(mean))) > _PIXEL_MEAN:
      return layer
    return _STOP
  return None


def _find(model):
  """The first scaling layer of `model` (in nested models too) before any
  layer with weights; _STOP if such a layer (or another scaling) comes
  first; None if neither."""
  import keras  # pylint: disable=g-import-not-at-top
  for layer in getattr(model, "layers", ()):
    if isinstance(layer, keras.layers.InputLayer):
      continue
    if isinstance(layer, keras.Model):
      found = _find(layer)
      if found is not None:
        return found
      continue
    found = _scaling_layer(layer)
    if found is not None:
      return found
    # Weightless layers (augmentation, reshapes) pass pixels on as pixels.
    if layer.weights:
      return _STOP
  return None


def expects_pixels(model):
  """The layer of `model` that expects 0-255 pixels (a Rescaling by about
  1/255 or a Normalization of 0-255 statistics before any layer with
  weights, looking into nested models), or None."""
  found = _find(model)
  return None if found is _STOP else found


def wrapped(model):
  """Whether `model` is `give_pixels`'s wrapper (its input times 255)."""
  return any(getattr(layer, "name", None) == WRAPPER_LAYER
             for layer in getattr(model, "layers", ())[:2])


def describe(layer):
  """'Rescaling rescaling (scale=0.003922)' for the log line."""
  if hasattr(layer, "scale"):
    what = f"scale={float(np.max(np.asarray(layer.scale))):.6g}"
  else:
    what = f"mean up to {float(np.max(np.asarray(layer.mean))):.4g}"
  return f"{type(layer).__name__} {layer.name!r} ({what})"


def give_pixels(model, name, scaled_pixels=None, why=None):
  """`model`, or a model that multiplies its input by 255 and calls
  `model`, when `model` expects 0-255 pixels and gets them divided by 255.

  Args:
    model: the built model.
    name: the model's name, for the log line.
    scaled_pixels: True: its inputs are uint8 images that the pipeline divided by
      255 (wrapped); False: its inputs reach it as they are, not scaled
      pixels (never wrapped); None: not known, assumed True (logged).
    why: what decided `scaled_pixels`, for the log line (e.g. "dataset=numpy has
      float32 features").
  """
  layer = expects_pixels(model)
  if layer is None:
    return model
  if scaled_pixels is False:
    logging.info(
        "model=%s starts with %s, which expects 0-255 pixels; %s, so the "
        "model gets its input as it is (no times 255)", name, describe(layer),
        why or "its inputs are not uint8 images divided by 255")
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
  if scaled_pixels is None:
    why = why or ("assumed its inputs are uint8 images divided by 255 (the "
                  "input pipeline's contract); build it with scaled_pixels=False "
                  "for inputs that reach it as they are")
  logging.info(
      "model=%s starts with %s, which expects 0-255 pixels; %s, so the "
      "model gets its input times 255 (layer %s)", name, describe(layer),
      why or "the input pipeline gives [0, 1] (uint8/255)", WRAPPER_LAYER)
  return keras.Model(inputs, model(x), name=model.name)
