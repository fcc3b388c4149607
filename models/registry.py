"""Model builders found by name or by import path.

A builder is `build(input_shape, num_classes, **options) -> keras.Model` that
returns logits, or takes the keyword form `input_shape=, classes=` of
`keras.applications` (see `models.builder_forms`). `build_model` passes each
builder only the options its signature names (all of them if a positional
builder takes `**kwargs`), so one set of script flags serves every model.

A model is either a registered name (`cifar_cnn`, see `register`) or the
import path of any builder, `package.module:function`: no registration, so
`evaluate.py`, `predict.py` and the export rebuild it in a fresh process from
what `model_info.json` records (`model` and `model_import_dir`, see
`import_dir`).
"""

import importlib
import inspect
import os
import sys
import sysconfig
import types
import typing

from framework.errors import ConfigError
from models import builder_forms, input_scale

_BUILDERS = {}
_TASKS = {}  # name -> one of TASKS, where declared
_FLOPS = {}  # name -> flops(model): training FLOPs per example, where declared
# `custom`: not a classifier; its trainer's `compute_loss` is the task (an
# autoencoder, a VAE, a regression): no check of outputs against classes.
CUSTOM = "custom"
TASKS = ("classification", "segmentation", "language_model", CUSTOM)
# How a model that is not a classifier runs (in the errors that meet one).
CUSTOM_HINT = ("a model that is not a classifier runs with a Trainer "
               "subclass that sets task = 'custom' and overrides "
               "compute_loss (docs/guide/own_model.md)")
# The modules of this package that register the built-in builders (and the
# gpt split), imported at the first look-up: `import models` stays free of
# TensorFlow.
BUILTIN_MODULES = ("cifar_cnn", "gpt", "gpt_parallel", "mlp", "unet")
# A built-in name's own modules: a run of one model loads only those (an
# mlp run no model-parallel layers).
_BUILTIN_OF = {"cifar_cnn": ("cifar_cnn",), "gpt": ("gpt", "gpt_parallel"),
               "mlp": ("mlp",), "unet": ("unet",)}
_loaded = []


def load_builtin(name=None):
  """Imports the modules that register the built-in model `name` (any other
  name, or None: every built-in module), once; they register here."""
  if name in _BUILTIN_OF:
    for module in _BUILTIN_OF[name]:
      importlib.import_module(f"models.{module}")
  elif not _loaded:
    _loaded.append(True)
    for module in BUILTIN_MODULES:
      importlib.import_module(f"models.{module}")


def register(name, task=None, flops=None):
  """Decorator: makes a builder available to `build_model(name, ...)`.

  Args:
    task: "classification" (logits [batch, classes]), "segmentation"
      (logits [batch, height, width, classes]) or "language_model"; lets a
      run refuse a dataset of the other kind before it writes anything.
      "custom": not a classifier (any outputs), trained only by a Trainer
      with `task = "custom"` whose `compute_loss` defines the loss. None:
      not checked before the model is built.
    flops: `(model) -> training FLOPs per example` of a built model, where
      a closed form is known (None: counted in its traced graph).
  """
  if ":" in name:
    raise ConfigError(f"model name {name!r} must not contain ':' (that "
                      "marks an import path package.module:function)")
  if task is not None and task not in TASKS:
    raise ConfigError(f"task={task!r} is not valid; choose one of: "
                      f"{', '.join(TASKS)}")

  def wrap(builder):
    _BUILDERS[name] = builder
    _TASKS[name] = task
    if flops is not None:
      _FLOPS[name] = flops
    return builder

  return wrap


def model_names():
  load_builtin()
  return sorted(_BUILDERS)


def is_import_path(name):
  return ":" in name


def _valid(name):
  return (f"model={name!r} is not valid: use a registered model "
          f"({', '.join(model_names())}) or an import path "
          "package.module:function")


def _import_module(name, module_name, search_dir):
  """Imports `module_name`; if it is not on sys.path, also tries
  `search_dir` (recorded by the training run) and the current directory
  (scripts run from elsewhere do not have it on sys.path)."""
  tried = []
  for extra in (None, search_dir, os.getcwd()):
    if extra is not None:
      extra = os.path.abspath(extra)
      if extra in tried or extra in map(os.path.abspath, sys.path):
        continue
      tried.append(extra)
      sys.path.append(extra)  # after sys.path: never shadows installed code
    try:
      return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
      # Only "the module itself is missing" moves on; a missing dependency
      # of the user's module is its own error.
      if not (e.name and (module_name == e.name or
                          module_name.startswith(e.name + "."))):
        raise ConfigError(f"model={name!r}: importing {module_name} failed: "
                          f"{e}") from None
      if extra is not None:
        sys.path.remove(extra)
  where = ", ".join(["sys.path"] + tried)
  raise ConfigError(f"{_valid(name)}; no module named {module_name!r} "
                    f"(looked in {where}; add its directory to PYTHONPATH)")


def get_builder(name, search_dir=None):
  """The builder for a registered name or a `module:function` import path.

  Args:
    name: e.g. `mlp` or `my_models.nets:build_resnet`.
    search_dir: a directory to import the module from if it is not on
      sys.path (model_info.json's `model_import_dir`).
  """
  if not isinstance(name, str) or not name:
    raise ConfigError(_valid(name))
  load_builtin(name)
  if not is_import_path(name):
    if name not in _BUILDERS:
      raise ConfigError(f"model={name!r} is unknown; known models: "
                        f"{', '.join(model_names())}, or an import path "
                        "package.module:function")
    return _BUILDERS[name]
  module_name, _, attribute = name.partition(":")
  if not module_name or not attribute:
    raise ConfigError(_valid(name))
  check_import_path(name)
  module = _import_module(name, module_name, search_dir)
  builder = module
  for part in attribute.split("."):
    if not hasattr(builder, part):
      hint = ""
      if module_name == "__main__":
        hint = (" (it was defined in the script that trained; move it to a "
                "module so that other processes can import it)")
      if not hint:
        hint = builder_forms.unknown_attribute_hint(builder, part)
      raise ConfigError(f"model={name!r}: module {module_name} has no "
                        f"attribute {attribute!r}{hint}")
    builder = getattr(builder, part)
  if not callable(builder):
    raise ConfigError(f"model={name!r}: {attribute} is a "
                      f"{type(builder).__name__}, not a callable "
                      "build(input_shape, num_classes, **options)")
  return builder


def check_import_path(name):
  """ConfigError unless import path `name` is `package.module:attribute`
  of dotted identifiers whose attribute parts are public (no leading
  underscore: no dunder or private attribute is ever reached)."""
  module_name, _, attribute = name.partition(":")
  parts = attribute.split(".")
  if (all(p.isidentifier() for p in module_name.split("."))
      and all(p.isidentifier() and not p.startswith("_") for p in parts)):
    return
  raise ConfigError(
      f"model={name!r} is not valid: an import path is package.module:"
      "function, the function named by public identifiers (e.g. "
      "keras.applications:ResNet50 or my_models.nets:build); attributes "
      "starting with '_' are refused")


def import_dir(name):
  """The directory to put on sys.path to import model `name` (None for a
  registered name or a module that cannot be located).

  `model_info.json` records it, so a later process (another directory, no
  PYTHONPATH) imports the same module.
  """
  if not is_import_path(name):
    return None
  module_name = name.partition(":")[0]
  top = sys.modules.get(module_name.split(".")[0])
  if module_name == "__main__":
    top = sys.modules["__main__"]
  path = getattr(top, "__file__", None)
  if path is None:
    return None
  path = os.path.dirname(os.path.abspath(path))
  if os.path.basename(top.__file__).startswith("__init__."):
    path = os.path.dirname(path)  # a package: its parent is on sys.path
  return path


def import_path_of(builder):
  """`module:qualname` that imports `builder` again, or None (lambdas,
  nested functions and objects without a module-level name)."""
  module = getattr(builder, "__module__", None)
  qualname = getattr(builder, "__qualname__", None)
  if not module or not qualname or "<" in qualname:
    return None
  return f"{module}:{qualname}"


def call_builder(builder, input_shape, num_classes, options, name=None, *,
                 scaled_pixels=None, why=None):
  """`_call_builder`'s model; weights that cannot be allocated (widths from
  a typo or an edited `model_info.json`) are a ConfigError naming the model
  and its options, not TensorFlow's ResourceExhaustedError."""
  try:
    return _call_builder(builder, input_shape, num_classes, options, name,
                         scaled_pixels=scaled_pixels, why=why)
  except Exception as e:  # pylint: disable=broad-except
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(e, tf.errors.ResourceExhaustedError):
      raise
    name = name or import_path_of(builder) or repr(builder)
    lines = [l for l in str(e).strip().splitlines() if l.strip()]
    first = lines[0] if lines else type(e).__name__
    first = first.split("}}")[-1].strip()[:200]
    raise ConfigError(
        f"model={name!r} with model_options {dict(options)} cannot be "
        f"built: its weights do not fit in memory ({first}); use smaller "
        "widths") from None


def _call_builder(builder, input_shape, num_classes, options, name=None, *,
                  scaled_pixels=None, why=None):
  """Calls `builder` in its form (`models.builder_forms`) with the options
  it accepts: `builder(input_shape=, classes=, ...)` or
  `builder(input_shape, num_classes, **options)`.

  Raises ConfigError naming the builder (`name`, else its import path) if
  its signature fits neither form or it returns no `keras.Model`; the
  user's function is only called once its arguments fit. `scaled_pixels`
  and `why`: whether its inputs are uint8 images divided by 255, and what
  says so (`models.input_scale.give_pixels`).
  """
  name = name or import_path_of(builder) or repr(builder)
  signature = builder_forms.signature_of(builder)
  if builder_forms.classes_keyword(signature):
    kwargs = builder_forms.keyword_arguments(name, signature, input_shape,
                                             num_classes, options)
    model = _call_with_weights(builder, kwargs, name)
    builder_forms.check_logits(name, model)
  else:
    if builder_forms.names_one_only(signature):
      raise builder_forms.refuse(name, builder, signature)
    parameters = signature.parameters.values() if signature else ()
    if signature and not any(p.kind == p.VAR_KEYWORD for p in parameters):
      accepted = {p.name for p in parameters}
      options = {k: v for k, v in options.items() if k in accepted}
    try:
      if signature is None:
        raise TypeError("its signature cannot be read")
      signature.bind(tuple(input_shape), num_classes, **options)
    except TypeError as e:
      raise builder_forms.refuse(name, builder, signature, e) from None
    try:
      model = builder(tuple(input_shape), num_classes, **options)
    except TypeError as e:
      if e.__traceback__.tb_next is not None and not _standard_library(
          builder):
        raise  # raised inside the function: the user's own error
      # The call itself failed, or a function of Python's own did: not a
      # model function at all (builtins:eval, os.path:join), one line.
      raise builder_forms.refuse(name, builder, signature, e) from None
  import keras  # pylint: disable=g-import-not-at-top
  if not isinstance(model, keras.Model):
    got = "None" if model is None else f"a {type(model).__name__}"
    raise ConfigError(
        f"model={name!r} returned {got}, not a keras.Model: the model "
        "function must return the model (a keras.Model of logits)")
  # A model that rescales its own input gets the 0-255 pixels it expects.
  return input_scale.give_pixels(model, name, scaled_pixels, why)


def _call_with_weights(builder, kwargs, name):
  """`builder(**kwargs)`; a `weights` file that does not fit the model is
  a ConfigError naming it (the builder is called again without it to tell
  that failure from any other)."""
  if kwargs.get("weights") is None:
    return builder(**kwargs)
  try:
    return builder(**kwargs)
  except Exception as e:  # pylint: disable=broad-except  (Keras's loaders)
    try:
      builder(**dict(kwargs, weights=None))
    except Exception:  # pylint: disable=broad-except
      raise e from None  # not the weights' fault
    lines = str(e).strip().splitlines()
    raise ConfigError(
        f"model={name!r}: model_options weights={kwargs['weights']!r} does "
        f"not fit the model ({lines[0] if lines else type(e).__name__}); "
        f"expected {builder_forms.WEIGHTS_FILES} with the same options") from None


def _standard_library(function):
  """Whether `function` is Python's own (its module in the standard
  library), not a model function anyone wrote."""
  module = inspect.getmodule(function)
  path = getattr(module, "__file__", None)
  if module is None or path is None:
    return True  # builtins and C modules
  stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
  path = os.path.realpath(path)
  return path.startswith(stdlib + os.sep) and "site-packages" not in path


def check_model(name, options=None, search_dir=None, *, resuming=False):
  """ConfigError, before any work, if model `name` cannot be found or the
  options do not fit it (keyword form: a `weights` file that is not there
  or not a Keras weights file, unless `resuming` from a checkpoint, which
  holds every weight; a `classifier_activation` other than logits)."""
  builder = get_builder(name, search_dir)
  if builder_forms.classes_keyword(builder_forms.signature_of(builder)):
    if not resuming:
      builder_forms.check_weights(name, options or {})
    builder_forms.check_activation(name, options or {})
  return builder


def architecture_options(name, options, search_dir=None):
  """`options` for building model `name` whose weights then come from a
  checkpoint or weights file: a keyword-form builder's initial `weights`
  file is not loaded (it may have moved since the run began)."""
  signature = builder_forms.signature_of(get_builder(name, search_dir))
  return builder_forms.without_initial_weights(signature, options)


def taken_options(name, options, search_dir=None):
  """The subset of `options` that `build_model(name, ...)` passes to the
  builder (what `model_info.json` records): the keywords its signature
  names, all of them for a positional builder with `**kwargs`; `options`
  as they are if the builder cannot be found here."""
  try:
    builder = get_builder(name, search_dir)
  except ConfigError:
    return dict(options)
  signature = builder_forms.signature_of(builder)
  if signature is None:
    return dict(options)
  accepted = builder_forms.option_parameters(signature)
  if any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
    taken = dict(options)
  else:
    taken = {k: v for k, v in options.items() if k in accepted}
  if is_import_path(name) and name.split(".")[0].split(":")[0] not in (
      "keras", "tensorflow"):
    # A function of one's own is called with its own defaults for what
    # was not set: recorded, so that model_info.json says what it built.
    for key, parameter in accepted.items():
      if (key not in taken and key not in builder_forms.KEYWORD_DEFAULTS
          and _plain(parameter.default)):
        taken[key] = parameter.default
  return taken


def _plain(value):
  """Whether `value` is JSON-like data (a default worth recording)."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value is not inspect.Parameter.empty
  if isinstance(value, (list, tuple)):
    return all(_plain(v) for v in value)
  return False


def check_outputs(name, model, num_classes, dataset):
  """ConfigError naming model `name` unless it has one output whose last
  axis has one logit per class of `dataset`."""
  try:
    outputs = list(model.outputs)
    width = model.output_shape[-1]
  except (AttributeError, TypeError, ValueError, IndexError):
    return  # an unbuilt subclassed model: its outputs show when it runs
  if len(outputs) > 1:
    names = list(getattr(model, "output_names", None) or [])
    names += [f"output_{i}" for i in range(len(names), len(outputs))]
    seen = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, outputs))
    raise ConfigError(
        f"model={name!r} has {len(outputs)} outputs ({seen}) but "
        f"dataset={dataset!r} is classified with one output of "
        f"{num_classes} logits per example; {CUSTOM_HINT}")
  if width is not None and width != num_classes:
    raise ConfigError(
        f"model={name!r} outputs {width} logits per example but "
        f"dataset={dataset!r} has {num_classes} classes: its last layer "
        "needs num_classes units (the model function's second argument)")


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _parse_scalar(kind, text):
  """`text` as a `kind` (bool, int, float or str); None: guess."""
  if kind is bool or (kind is None and text.lower() in _TRUE + _FALSE):
    if text.lower() not in _TRUE + _FALSE:
      raise ValueError("not a boolean (true or false)")
    return text.lower() in _TRUE
  if kind is None:
    for guess in (int, float):
      try:
        return guess(text)
      except ValueError:
        pass
    return text
  if kind is float:
    return float(text)
  if kind is int:
    return int(text)
  return text


def _option_kind(parameter):
  """(sequence type or None, element type or None) of a builder keyword,
  from its annotation, else from its default."""
  hint = parameter.annotation
  if hint is inspect.Parameter.empty:
    default = parameter.default
    if isinstance(default, (list, tuple)):
      return type(default), type(default[0]) if default else None
    if default is None or default is inspect.Parameter.empty:
      return None, None
    return None, type(default)
  origin = typing.get_origin(hint)
  if hint in (list, tuple) or origin in (list, tuple):
    args = [a for a in typing.get_args(hint) if a is not Ellipsis]
    return origin or hint, args[0] if len(args) == 1 else None
  if origin in (typing.Union, types.UnionType):  # Optional[X]: X
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    hint = args[0] if len(args) == 1 else None
  return None, hint if hint in (bool, int, float, str) else None


def check_flag_options(name, options, flags):
  """ConfigError unless each of `options` (built-in model flags given on
  the command line, by name: `flags` maps an option to its flag) has the
  kind model `name`'s builder takes: `--dropout` is cifar_cnn's bool, not
  a function of one's own's float rate."""
  try:
    signature = inspect.signature(get_builder(name))
  except (ConfigError, TypeError, ValueError):
    return
  accepted = builder_forms.option_parameters(signature)
  for key, value in options.items():
    if key not in accepted:
      continue
    sequence, element = _option_kind(accepted[key])
    if sequence is None and element is None:
      continue  # untyped: anything goes
    is_list = isinstance(value, (list, tuple))
    got = type(value[0]) if is_list and value else type(value)
    if (sequence is not None) == is_list and (
        element is None or (element is bool) == (got is bool)
        and (element is not int or got is int)
        and (element is not str or got is str)):
      continue
    kind = (f"a list of {element.__name__}" if sequence and element
            else getattr(element, "__name__", "a list"))
    raise ConfigError(
        f"--{flags.get(key, key)}={_show_value(value)} is the built-in "
        f"models' flag, but model={name!r} takes {key} as {kind} "
        f"(its default: {accepted[key].default!r}); set it with "
        f"--model_options={key}=VALUE")


def _show_value(value):
  if isinstance(value, (list, tuple)):
    return ",".join(str(v) for v in value)
  return str(value).lower() if isinstance(value, bool) else str(value)


def parse_options(name, text):
  """{option: value} from `key=value,...` for model `name`'s builder.

  Each value is typed from the builder's signature (annotation, else the
  default's type); a list value continues after commas
  (`hidden_units=32,16,dropout=false`). The input shape and the class
  count (a positional builder's first two arguments) are not options; a
  keyword-form builder's `classifier_activation` must give logits (its
  `weights` file is checked by `check_model`).

  Raises:
    ConfigError: naming the bad key or value and the valid keys.
  """
  signature = inspect.signature(get_builder(name))
  keyword_form = builder_forms.classes_keyword(signature)
  takes_any = any(p.kind == p.VAR_KEYWORD
                  for p in signature.parameters.values())
  options = builder_forms.option_parameters(signature)
  valid = ", ".join(options) or "none"
  items = []
  for token in text.split(",") if text else []:
    if "=" in token:
      items.append(list(token.split("=", 1)))
    elif items:
      items[-1][1] += "," + token
    else:
      raise ConfigError(f"model_options={text!r}: {token!r} is not "
                        f"key=value; valid keys for model={name!r}: {valid}")
  values = {}
  for key, raw in items:
    if key not in options and not takes_any:
      raise ConfigError(f"model_options: {key!r} is not an option of "
                        f"model={name!r}; valid keys: {valid}")
    sequence, kind = (_option_kind(options[key]) if key in options
                      else (None, None))
    try:
      if sequence is not None:
        value = sequence(_parse_scalar(kind, v) for v in raw.split(",")
                         if v) if raw else sequence()
      elif "," in raw and kind is not str:
        raise ValueError("one value expected")
      else:
        value = _parse_scalar(kind, raw)
    except ValueError as e:
      what = getattr(kind, "__name__", "value")
      if sequence is not None:
        what = f"list of {what}"
      raise ConfigError(f"model_options: {key}={raw!r} is not a valid "
                        f"{what} ({e}); valid keys for model={name!r}: "
                        f"{valid}") from None
    values[key] = value
  if keyword_form:
    # The weights file is checked by the run, which knows whether it
    # resumes (then the file is not needed).
    builder_forms.check_activation(name, values)
  return values


def declared_task(name):
  """The task model `name` was registered with (one of `TASKS`), or None
  (an import path, or registered without one: its outputs tell)."""
  load_builtin(name)
  return _TASKS.get(name)


def flops_counter(name):
  """The `flops` model `name` was registered with, or None."""
  load_builtin(name)
  return _FLOPS.get(name)


def check_task(name, per_pixel, dataset, model=None, label_shape=None):
  """Raises ConfigError unless model `name` solves the dataset's task.

  Args:
    per_pixel: whether the dataset has one label per pixel (segmentation),
      or the dataset's task by name (one of `TASKS`).
    dataset: the dataset's name, for the message.
    model: the built model, if any: its output rank decides for a model
      registered without a task.
    label_shape: the shape of one example's labels, if known: the message
      says what was seen.
  """
  load_builtin(name)
  if isinstance(per_pixel, str):
    want = per_pixel
  else:
    want = "segmentation" if per_pixel else "classification"
  task = _TASKS.get(name)
  if want == CUSTOM:
    return  # the trainer defines the task: any model
  if task == CUSTOM:
    raise ConfigError(
        f"model={name!r} is registered with task='custom' (not a "
        f"classifier) but the run's trainer is a {want} trainer; "
        f"{CUSTOM_HINT}")
  if task is None and model is not None:
    try:
      rank = len(model.output_shape)
    except (AttributeError, TypeError, ValueError):
      rank = None  # a subclassed model has no static output shape
    if rank is not None:
      task = "segmentation" if rank == 4 else "classification"
  if task is None or task == want:
    return
  fitting = [n for n in model_names() if _TASKS.get(n) == want]
  labels = {"segmentation": "one class per pixel",
            "language_model": "the next token at every position"}.get(
                want, "one class per image")
  if label_shape is not None:
    labels += f": its labels have shape {list(label_shape)} per example"
  raise ConfigError(
      f"model={name!r} is a {task} model but dataset={dataset!r} is a {want} "
      f"task ({labels}); use a {want} model: {', '.join(fitting) or 'none'}")


def build_model(name, input_shape, num_classes, *, search_dir=None,
                scaled_pixels=None, why=None, **options):
  """Builds model `name`; options it does not take are ignored.

  `scaled_pixels`: whether its inputs are uint8 images divided by 255 (a
  model that expects 0-255 pixels then gets them); None: assumed so, and
  logged if it matters (`models.input_scale.give_pixels`); `why` says
  what decided it, for that line.
  """
  return call_builder(get_builder(name, search_dir), input_shape, num_classes,
                      options, name=name, scaled_pixels=scaled_pixels,
                      why=why)
