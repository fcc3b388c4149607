"""The two ways a builder is called: positionally or by keyword.

A builder is called in one of two forms, read from its signature:

- the keyword form, when it names `input_shape` and `classes` (or
  `num_classes`), as every `keras.applications` model does:
  `builder(input_shape=..., classes=..., **options it names)`, with
  `weights=None` (a fresh model; `--model_options=weights=PATH` names a
  local weights file instead) and `classifier_activation=None` (logits)
  where the signature has them;
- the positional form, `build(input_shape, num_classes, **options)`, for a
  builder that names neither (e.g. `build(shape, n)`).

A signature that names only one of them fits neither and is refused in one
line. So `--model=keras.applications:ResNet50` trains a ResNet50 on the
dataset's image shape and classes without a line of user code.
"""

import difflib
import inspect
import os
import zipfile

from framework.errors import ConfigError

SHAPE = "input_shape"
CLASSES = ("classes", "num_classes")
EXPECTED = ("build(input_shape, num_classes, **options) or keywords "
            "input_shape= and classes= (or num_classes=), as "
            "keras.applications models take")
# The keyword form's defaults where the signature names them: untrained
# weights (no download) and logits, which the losses expect.
KEYWORD_DEFAULTS = {"weights": None, "classifier_activation": None}


def signature_of(builder):
  """inspect.Signature of `builder`, or None when it cannot be read."""
  try:
    return inspect.signature(builder)
  except (TypeError, ValueError):
    return None


def classes_keyword(signature):
  """The keyword taking the class count (`classes` or `num_classes`) when
  `signature` is of the keyword form, else None."""
  if signature is None or SHAPE not in signature.parameters:
    return None
  for name in CLASSES:
    if name in signature.parameters:
      return name
  return None


def names_one_only(signature):
  """Whether `signature` names `input_shape` or a class count but not both
  (neither form: refused)."""
  if signature is None or classes_keyword(signature):
    return False
  names = set(signature.parameters)
  return SHAPE in names or any(n in names for n in CLASSES)


def option_parameters(signature):
  """{name: Parameter} of the options `signature` takes: all keywords but
  the input shape and the class count (keyword form), or all but the first
  two (positional form)."""
  parameters = list(signature.parameters.values())
  if classes_keyword(signature):
    skip = {SHAPE, *CLASSES}
    parameters = [p for p in parameters if p.name not in skip]
  else:
    parameters = parameters[2:]
  return {p.name: p for p in parameters
          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_weights(name, options):
  """ConfigError unless `options["weights"]` (if any, and not None) names a
  local file that reads as a Keras weights file (.weights.h5, .h5 or
  .keras): a keyword-form model is never downloaded."""
  weights = options.get("weights")
  if _is_none(weights):
    return
  if not isinstance(weights, str) or not os.path.isfile(weights):
    raise ConfigError(
        f"model={name!r}: model_options weights={weights!r} is not a local "
        "file; name a weights file (.weights.h5) that fits the model, or "
        "leave weights out to start from random weights")
  problem = _unreadable(weights)
  if problem:
    raise ConfigError(
        f"model={name!r}: model_options weights={weights!r} is not a Keras "
        f"weights file ({problem}); expected {WEIGHTS_FILES}")


# What `weights=` may name: what `model.save_weights` or `model.save` wrote.
WEIGHTS_FILES = ("a .weights.h5 file (model.save_weights), a legacy .h5 "
                 "file or a .keras file (model.save) of this model")


def _unreadable(path):
  """Why `path` cannot be a Keras weights file, or None."""
  if path.endswith(".keras"):
    if not zipfile.is_zipfile(path):
      return "not a zip archive: damaged or truncated"
    try:
      with zipfile.ZipFile(path) as archive:
        if "model.weights.h5" not in archive.namelist():
          return "a zip archive without model.weights.h5"
    except (zipfile.BadZipFile, OSError) as e:
      return f"damaged zip archive: {e}"
    return None
  if not path.endswith((".h5", ".hdf5")):
    return "its name ends in neither .weights.h5, .h5 nor .keras"
  import h5py  # pylint: disable=g-import-not-at-top  (Keras's dependency)
  try:
    with h5py.File(path, "r") as f:
      f.visit(lambda _: None)  # every group's header, not the values
  except (OSError, ValueError, RuntimeError) as e:
    lines = str(e).strip().splitlines()
    return f"not a complete HDF5 file: {lines[0] if lines else e}"
  return None


def check_activation(name, options):
  """ConfigError if `options` ask a keyword-form model for probabilities
  (`classifier_activation` other than None or linear): distloop's losses,
  metrics and export take logits."""
  value = options.get("classifier_activation")
  if _is_none(value) or value == "linear":
    return
  raise ConfigError(
      f"model={name!r}: model_options classifier_activation={value!r} is "
      "not supported: distloop's losses take logits; use "
      "classifier_activation=None (or linear), or leave it out")


def check_logits(name, model):
  """ConfigError if `model`'s final layer applies softmax (probabilities,
  not the logits distloop's losses take)."""
  import keras  # pylint: disable=g-import-not-at-top
  layer = model.layers[-1] if getattr(model, "layers", None) else None
  if layer is None:
    return
  softmax = (isinstance(layer, keras.layers.Softmax) or
             getattr(layer, "activation", None) is keras.activations.softmax)
  if softmax:
    raise ConfigError(
        f"model={name!r}: its final layer {layer.name!r} applies softmax; "
        "distloop's losses take logits: build it with "
        "classifier_activation=None (or linear)")


def without_initial_weights(signature, options):
  """`options` with `weights=None` for a keyword-form builder: the
  architecture alone, for a model whose weights come from a checkpoint."""
  if classes_keyword(signature) and not _is_none(options.get("weights")):
    return dict(options, weights=None)
  return options


def _is_none(value):
  """Whether an option's value means None (None, '', none): random
  `weights`, no `classifier_activation`."""
  return value is None or (isinstance(value, str)
                           and value.lower() in ("", "none"))


def keyword_arguments(name, signature, input_shape, num_classes, options):
  """The keyword-form call's arguments: the input shape, the class count,
  `KEYWORD_DEFAULTS` the signature names, then the options it names (all
  of them if it takes `**kwargs`, as a positional builder)."""
  check_weights(name, options)
  check_activation(name, options)
  names = set(signature.parameters)
  kwargs = {k: v for k, v in KEYWORD_DEFAULTS.items() if k in names}
  takes_any = any(p.kind == p.VAR_KEYWORD
                  for p in signature.parameters.values())
  kwargs.update({k: v for k, v in options.items()
                 if takes_any or k in option_parameters(signature)})
  for key in ("weights", "classifier_activation"):
    if key in kwargs and _is_none(kwargs[key]):
      kwargs[key] = None
  kwargs[SHAPE] = tuple(input_shape)
  kwargs[classes_keyword(signature)] = num_classes
  return kwargs


def refuse(name, builder, signature, reason=None):
  """The one-line ConfigError for a builder of neither form."""
  why = f" ({reason})" if reason else ""
  return ConfigError(
      f"model={name!r}: {getattr(builder, '__name__', 'it')}"
      f"{signature or '(...)'} cannot be called as {EXPECTED}{why}; a model "
      "function takes the input shape and the number of classes and returns "
      "a keras.Model of logits")


def unknown_attribute_hint(module, attribute):
  """'; did you mean ...' naming close names in `module` (e.g. a
  misspelled keras.applications model), or ''."""
  names = [n for n in dir(module) if not n.startswith("_")]
  close = difflib.get_close_matches(attribute, names, n=3, cutoff=0.6)
  return f"; did you mean {', '.join(close)}?" if close else ""
