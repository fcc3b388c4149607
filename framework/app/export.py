"""What a training run leaves for inference, besides its checkpoints.

    model_dir/model_info.json    model name or import path (and the directory
                                 to import it from), options, input shape,
                                 class names (written when training starts)
    model_dir/model.weights.h5   the final Keras weights (experiment.run)
    model_dir/export/            a SavedModel with serving signatures

The weights are plain values with no trace of the strategy or replica count
that trained them, so `build_inference_model(info)` + `load_weights` rebuilds
the model on a CPU-only process.

`describe_run` writes the record for a loop you drive yourself
(`framework.Controller`): its checkpoints are restorable by the scripts,
but only you know how its model is built and which data it learned from;
one call says so:

    framework.describe_run("runs/mine", my_nets.build, dataset="numpy",
                           data_dir="data.npz", model_options={"width": 64})
"""

import functools
import json
import os
from typing import Callable, Optional, Sequence

import keras
import numpy as np
from absl import logging
import tensorflow as tf

import models
from models import input_scale, registry
from framework.app import resume
from framework.app.config import EvalConfig, ExperimentConfig
from framework.core import adapt
from framework.core.checkpoints import manager, run_files
from framework.core.config import TrainerConfig
from framework.data import config as data_config, datasets, preprocessing
from framework.data.config import InputConfig
from framework.data.inputs import to_float
from framework.data.text import TASK as LANGUAGE_MODEL, is_text
from framework.errors import CheckpointError, ConfigError
from framework.settings import default

# What decides a resume lives in `resume`; its names here keep working.
MODEL_INFO_FILE = resume.MODEL_INFO_FILE
run_config = resume.run_config
model_fingerprint = resume.model_fingerprint
config_changes = resume.config_changes
_NOT_ARCHITECTURE = resume._NOT_ARCHITECTURE  # pylint: disable=protected-access
_jsonable = resume.jsonable
WEIGHTS_FILE = "model.weights.h5"
# With an EMA, WEIGHTS_FILE holds the averaged weights and this the raw ones.
RAW_WEIGHTS_FILE = "model.raw.weights.h5"
EXPORT_DIR = "export"
# Options that change how a model trains but not its weights.
_TRAINING_ONLY_OPTIONS = resume.TRAINING_ONLY_OPTIONS


def model_info(config, dataset, *, task=None, trainer_cls=None):
  """The JSON-able description `build_inference_model` needs (and context).

  `task`: the run's (a `RunPlan`'s); `custom` also records `trainer_cls`'s
  import path, whose `eval_loss` evaluate.py needs (`trainer_of`).
  """
  custom = {}
  if task == registry.CUSTOM:
    while isinstance(trainer_cls, functools.partial):
      trainer_cls = trainer_cls.func
    custom = {"task": task,
              "trainer": registry.import_path_of(trainer_cls),
              "trainer_import_dir": None}
    if custom["trainer"]:
      custom["trainer_import_dir"] = registry.import_dir(custom["trainer"])
  return {"model": config.model,
          # A `module:function` model is imported from here when it is not
          # on the reading process's sys.path (another cwd, no PYTHONPATH).
          "model_import_dir": registry.import_dir(config.model),
          # Only the options the builder took (not every model's flags).
          "model_options": _jsonable(registry.taken_options(
              config.model, config.model_options)),
          "input_shape": list(dataset.input_shape),
          "num_classes": dataset.num_classes,
          "class_names": list(dataset.class_names),
          "dataset": config.dataset,
          "data_dir": config.data_dir,
          "dataset_options": _jsonable(data_config.read_options(
              config.dataset, getattr(config, "dataset_options", {}))),
          "global_batch_size": config.global_batch_size,
          "strategy": config.strategy,
          "seed": config.seed,
          # How the run evaluates, so that evaluate.py reports the same.
          "ema_decay": getattr(config, "ema_decay", None),
          "eval_tta": getattr(config, "eval_tta",
                              default(TrainerConfig, "eval_tta")),
          "label_smoothing": getattr(config, "label_smoothing",
                                     default(ExperimentConfig,
                                             "label_smoothing")),
          # The compute precision it evaluated in (`auto` resolved), which
          # evaluate.py uses too: bfloat16 and float32 differ in the 4th
          # digit.
          "mixed_precision": getattr(config, "mixed_precision",
                                     default(ExperimentConfig,
                                             "mixed_precision")),
          # Which side scales images (framework.data.preprocessing).
          "input_preprocessing": preprocessing.CONTRACT,
          # Token sequences, not images: predict.py generates, the export
          # takes int32 tokens.
          **({"task": LANGUAGE_MODEL} if is_text(dataset) else {}),
          **custom}


def write_model_info(model_dir, info):
  tf.io.gfile.makedirs(model_dir)
  return run_files.write_text(os.path.join(model_dir, MODEL_INFO_FILE),
                           json.dumps(info, indent=2, sort_keys=True))


def save_weights(model, path):
  """`model.save_weights(path)` through a temporary name (ModelDirError on
  a full disk; the previous weights file stays)."""
  return run_files.write_atomically(path, model.save_weights)


# model_info.json's fields a rebuild reads: (JSON types, what they are).
_INFO_FIELDS = {
    "model": (str, "a model name or module:function"),
    "model_options": (dict, "an object of options"),
    "input_shape": (list, "a list of positive integers"),
    "class_names": (list, "a list of strings"),
    "num_classes": (int, "an integer"),
    "model_import_dir": ((str, type(None)), "a folder or null"),
    "dataset": ((str, type(None)), "a dataset name or null"),
    "data_dir": ((str, type(None)), "a folder or null"),
    "global_batch_size": ((int, type(None)), "an integer or null"),
    "label_smoothing": ((int, float, type(None)), "a number or null"),
    "ema_decay": ((int, float, type(None)), "a number or null"),
    "mixed_precision": ((str, type(None)), "a precision name or null"),
    input_scale.RECORD: (bool, "true or false"),
    "run_plan": (dict, "an object"),
}


def read_model_info(model_dir):
  """The dict written by `write_model_info`, or None if there is none."""
  path = os.path.join(model_dir, MODEL_INFO_FILE)
  info = run_files.read_json(path, object_only=True)
  if info is None:
    return None
  missing = [k for k in ("model", "input_shape", "class_names")
             if k not in info]
  if missing:
    raise CheckpointError(f"{path} lacks {', '.join(missing)}")
  for key, (kinds, what) in _INFO_FIELDS.items():
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if key in info and not (isinstance(info[key], kinds) and not (
        isinstance(info[key], bool) and bool not in kinds)):
      raise CheckpointError(
          f"{path}: {key} is {json.dumps(info[key])[:80]}, not {what} "
          "(edited or damaged); restore the run's own file")
  if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
             for d in info["input_shape"]):
    raise CheckpointError(f"{path}: input_shape is {info['input_shape']}, "
                          "not a list of positive integers (edited or "
                          "damaged); restore the run's own file")
  # A resume compares the recorded split with its own (framework.app.resume).
  split = info.get("run_plan", {}).get("model_parallel")
  split = {} if split is None else split
  bad = ("run_plan.model_parallel", split, "an object")
  if isinstance(split, dict):
    bad = next(((f"run_plan.model_parallel.{k}", split[k], "a string")
                for k in ("mesh", "mode")
                if k in split and not isinstance(split[k], str)), None)
  if bad:
    raise CheckpointError(
        f"{path}: {bad[0]} is {json.dumps(bad[1])[:80]}, not {bad[2]} "
        "(edited or damaged); restore the run's own file")
  if not all(isinstance(n, str) for n in info["class_names"]):
    raise CheckpointError(f"{path}: class_names holds other values than "
                          "strings (edited or damaged); restore the run's "
                          "own file")
  if input_scale.RECORD not in info:
    # A run from before the record: its checkpoints' fingerprint tells
    # whether it was built with its input times 255 (`unrecorded_scale`).
    try:
      saved = manager.read_run_config(model_dir) or {}
    except CheckpointError:
      saved = {}
    if saved.get("model_fingerprint"):
      info = dict(info, **{RUN_FINGERPRINT: saved["model_fingerprint"]})
  return info


def read_model_info_quietly(model_dir, warn=False):
  """`read_model_info`, or None if it is missing or damaged (for a writer
  about to replace it); `warn`: a damaged one is one warning line (what it
  recorded, e.g. the input scale a resumed run was trained with, is lost)."""
  try:
    return read_model_info(model_dir)
  except CheckpointError as e:
    if warn:
      logging.warning("%s; it is written again from this launch's settings "
                      "(what only it recorded is lost)",
                      str(e).splitlines()[0])
    return None


def build_inference_model(
    info, *, trust_model_code=default(EvalConfig, "trust_model_code")):
  """The model described by `info`, built without any strategy, without
  its weights (a keyword-form model's initial `weights` file is not read:
  load the run's).

  Safe by default, as Keras's `safe_mode`: a registered model name is
  built; a `module:function` recorded in `info` is imported (which runs
  that module's code) only with `trust_model_code=True`, from `info`'s
  `model_import_dir` if it is not on `sys.path`. A model the caller names
  itself (`with_model`) is imported from the caller's `sys.path` or current
  folder, never from `model_import_dir`. Otherwise a ConfigError says how.
  """
  check_model_code(info, trust_model_code)
  name = info["model"]
  # The run's recorded folder is the run's code: only when trusted, and
  # never for a model the user named (their own copy, from their folders).
  search_dir = (info.get("model_import_dir")
                if trust_model_code and _NAMED_BY_USER not in info else None)
  recorded = info.get("model_options") or {}
  # Only where the builder took them: a `**options` builder that passes
  # its options on would get keywords it never had.
  options = dict(recorded, **{k: v for k, v in _TRAINING_ONLY_OPTIONS.items()
                              if k in recorded})
  options = {k: tuple(v) if isinstance(v, list) else v
             for k, v in options.items()}
  # Its weights come from the run (a checkpoint, the weights file), not
  # from the initial weights file it started from.
  options = registry.architecture_options(name, options,
                                          search_dir=search_dir)
  # A custom task's num_classes need not be classes (float targets).
  outputs = (info["num_classes"] if info.get("task") == registry.CUSTOM
             else len(info["class_names"]))
  _, model = unrecorded_scale(info, lambda **scale: models.build_model(
      name, info["input_shape"], outputs, search_dir=search_dir, **scale,
      **options))
  if info.get("task") != registry.CUSTOM:  # a classifier's outputs
    registry.check_outputs(name, model, len(info["class_names"]),
                           info.get("dataset"))
  return model


def output_shape(model, info):
  """`model`'s output shape; a subclassed model, which has none (and may
  have no weights yet), is called once on a symbolic input of `info`'s."""
  try:
    return tuple(model.output_shape)
  except AttributeError:
    dtype = "int32" if info.get("task") == "language_model" else "float32"
    return tuple(model(keras.Input(tuple(info["input_shape"]), dtype=dtype),
                       training=False).shape)


def recorded_scale(info):
  """`build_model`'s `scaled_pixels` and `why` for the run `info`
  describes: as it was built (`input_scale.RECORD`; absent: a run from
  before the record, built without the wrapper)."""
  if input_scale.RECORD in info:
    wrapped = bool(info[input_scale.RECORD])
    return {"scaled_pixels": wrapped,
            "why": f"{MODEL_INFO_FILE} records {input_scale.RECORD}="
                   f"{str(wrapped).lower()} for this run"}
  return {"scaled_pixels": False,
          "why": f"the run predates the {input_scale.RECORD} record of "
                 f"{MODEL_INFO_FILE} and so was trained on its inputs as "
                 "they are"}


def unrecorded_scale(info, build):
  """(`recorded_scale(info)`, `build(**it)`), where `build(scaled_pixels=,
  why=)` builds the run's model.

  A run folder written before the record was built either without the
  times-255 input (before the wrapper existed) or with it (the wrapper
  without its record). Built without it, the model's `model_fingerprint`
  equals the one its checkpoints were saved with (`read_model_info` reads
  it) only in the first case. (A wrapped model's own fingerprint depends on
  the names Keras gave its layers in that process: it is not compared.)
  """
  scale = recorded_scale(info)
  model = build(**scale)
  saved = info.get(RUN_FINGERPRINT)
  if (input_scale.RECORD in info or not saved or input_scale.wrapped(model)
      or model_fingerprint(model) == saved):
    return scale, model
  wrapped = {"scaled_pixels": True,
             "why": f"the run predates the {input_scale.RECORD} record of "
                    f"{MODEL_INFO_FILE}, and its checkpoints were saved "
                    "from the model with that input"}
  other = build(**wrapped)
  if input_scale.wrapped(other):
    return wrapped, other
  return scale, model


def check_model_code(
    info, trust_model_code=default(EvalConfig, "trust_model_code")):
  """ConfigError (saying how to go on) if building `info`'s model would
  import code that neither the registry nor the user vouches for."""
  name = info["model"]
  if registry.is_import_path(name) and not (
      trust_model_code or info.get(_NAMED_BY_USER) == name):
    where = info.get("model_import_dir")
    raise ConfigError(
        f"{MODEL_INFO_FILE} names the model function {name!r}"
        + (f" (in {where})" if where else "") + "; importing it runs that "
        "code, so it is not done by default: name your own copy of the code "
        "with --model (model=), imported from your PYTHONPATH or current "
        "folder, never the run's, or pass --trust_model_code "
        "(trust_model_code=True) to import it from the run's recorded "
        "folder")


def trainer_of(
    info, trust_model_code=default(EvalConfig, "trust_model_code")):
  """The trainer class a `task=custom` run recorded (its `eval_loss` is
  the run's evaluation), imported only with `trust_model_code=True` (it is
  the run's code, as a recorded model function is); else a ConfigError
  saying how."""
  path = info.get("trainer")
  if not path or path.startswith("__main__:"):
    raise ConfigError(
        f"{MODEL_INFO_FILE} records task=custom with the trainer "
        f"{path or '(no import path)'}, which another process cannot "
        "import: define the Trainer subclass at module level in a module "
        "of its own (not the script that trains) and train again")
  if not trust_model_code:
    where = info.get("trainer_import_dir")
    raise ConfigError(
        f"{MODEL_INFO_FILE} records task=custom with the trainer {path!r}"
        + (f" (in {where})" if where else "") + ", whose eval_loss is the "
        "run's evaluation; importing it runs that code, so it is not done "
        "by default: pass --trust_model_code (trust_model_code=True)")
  try:
    return registry.get_builder(path, info.get("trainer_import_dir"))
  except ConfigError as e:
    raise ConfigError(f"trainer={path!r} (task=custom): {e}") from None


# In-memory only (never written): the model a caller named itself.
_NAMED_BY_USER = "_model_named_by_user"
# `read_model_info`'s note of run_config.json's fingerprint, for a run
# folder without `input_scale.RECORD`.
RUN_FINGERPRINT = "_run_fingerprint"


def with_model(info, model):
  """`info` with the model the user named (`--model`): trusted code, since
  the user chose it; `model=None` leaves `info` as it is."""
  if not model:
    return info
  return dict(info, model=model, **{_NAMED_BY_USER: model})


class ServingModule(tf.Module):
  """uint8 images in, class probabilities out (the SavedModel's signature);
  for a language model (`task`), int32 tokens in, per-position next-token
  probabilities out."""

  def __init__(self, model, input_shape, class_names, task=None):
    super().__init__(name="serving")
    self.model = model
    # The random state of Keras's random layers (RandomFlip, Dropout, a
    # `keras.random` call with a seed generator) is in `model.variables` but
    # is no TensorFlow trackable of the model, and the serving function
    # reads it even with training=False: tracked here, as Keras's own
    # ExportArchive does, or the SavedModel refuses the function.
    self.model_variables = list(model.variables)
    self.class_names = tf.constant(list(class_names))
    if task == LANGUAGE_MODEL:
      self.serve = tf.function(self._serve_tokens, input_signature=[
          tf.TensorSpec([None] + list(input_shape), tf.int32, name="tokens")])
      return
    self.serve = tf.function(self._serve, input_signature=[
        tf.TensorSpec([None] + list(input_shape), tf.uint8, name="images")])

  def _serve_tokens(self, tokens):
    """Tokens [N, T]: probabilities [N, T, vocab] of the token after each
    position, and `next_token` [N], the most likely one after the last."""
    probabilities = tf.nn.softmax(tf.cast(self.model(tokens, training=False),
                                          tf.float32))
    return {"probabilities": probabilities,
            "next_token": tf.argmax(probabilities[:, -1], axis=-1,
                                    output_type=tf.int32)}

  def _serve(self, images):
    """Images [N, H, W, C] with values 0..255, as in training."""
    probabilities = tf.nn.softmax(self.model(to_float(images), training=False))
    predicted = tf.argmax(probabilities, axis=-1, output_type=tf.int32)
    return {"probabilities": probabilities, "class_index": predicted,
            "class_name": tf.gather(self.class_names, predicted)}


def export_saved_model(
    model, info, export_dir, *,
    trust_model_code=default(EvalConfig, "trust_model_code")):
  """Writes a SavedModel of `model`'s weights under `export_dir`.

  A fresh copy of the model is built outside any strategy, so the export
  holds plain variables. Its `serving_default` signature takes uint8 images
  [N, H, W, C] and returns `probabilities` (softmax over the last axis, so
  per pixel for segmentation), `class_index` and `class_name`; a language
  model's takes int32 `tokens` [N, T] and returns `probabilities` [N, T,
  vocab] and `next_token` [N]. `trust_model_code`: see `build_inference_model` (the training process
  passes True: its own config named the model).
  """
  plain = build_inference_model(info, trust_model_code=trust_model_code)
  plain.set_weights([np.asarray(w) for w in model.get_weights()])
  # Adapted preprocessing layers read their state once built: the run's.
  adapt.refresh(plain)
  module = ServingModule(plain, info["input_shape"], info["class_names"],
                         task=info.get("task"))
  return run_files.write_atomically(export_dir, lambda tmp: tf.saved_model.save(
      module, tmp, signatures={"serving_default": module.serve}))


# model_info.json's `train_input` and `eval_input`: a run on custom inputs
# (`experiment.run(train_input=..., eval_input=...)`) records so, since
# `evaluate.py` and `predict.py --index` cannot rebuild a user's pipeline:
# they refuse such a run in one line unless told which data to read.
CUSTOM = "custom"
DATASET = "dataset"


def data_sources(train_input, eval_input):
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


def describe_run(model_dir: str, build_model: Callable, *,
                 dataset: Optional[str] = None,
                 data_dir: Optional[str] = None,
                 input_shape: Optional[Sequence[int]] = None,
                 num_classes: Optional[int] = None,
                 class_names: Optional[Sequence[str]] = None,
                 model_options: Optional[dict] = None,
                 dataset_options: Optional[dict] = None,
                 global_batch_size: Optional[int] = None,
                 seed: int = default(InputConfig, "seed")) -> dict:
  """Writes `model_dir/model_info.json` for a Controller-trained run.

  Args:
    model_dir: the run's directory (its checkpoints).
    build_model: the module-level function that built the model.
    dataset, data_dir, dataset_options: the data it was trained and
      evaluated on, as `ExperimentConfig` names it (e.g. "numpy" and an
      `.npz`); its shape and classes are read from it.
    input_shape, num_classes, class_names: without `dataset`: the
      per-example feature shape and the classes (names default to
      class_0, ...).
    model_options: the keyword arguments `build_model` was called with.
    global_batch_size: the evaluation batch the scripts default to.
    seed: the dataset's seed (synthetic data depends on it).

  Returns:
    The dict written.
  """
  path = registry.import_path_of(build_model)
  if path is None or path.startswith("__main__:"):
    raise ConfigError(
        f"build_model={build_model!r} must be a module-level function of an "
        "importable module (not a lambda, a nested function or __main__), "
        "so that evaluate.py and predict.py can import it again")
  if dataset is not None:
    data = datasets.load_dataset(dataset, data_dir, seed=seed,
                                 **(dataset_options or {}))
    if input_shape is not None and tuple(input_shape) != tuple(
        data.input_shape):
      raise ConfigError(f"input_shape={tuple(input_shape)} disagrees with "
                        f"dataset={dataset}, which has "
                        f"{tuple(data.input_shape)}")
    if num_classes is not None and num_classes != data.num_classes:
      raise ConfigError(f"num_classes={num_classes} disagrees with "
                        f"dataset={dataset}, which has {data.num_classes}")
    input_shape, num_classes = data.input_shape, data.num_classes
    class_names = class_names or data.class_names
  elif input_shape is None or num_classes is None:
    raise ConfigError("describe_run needs dataset= (the data the run "
                      "learned from) or both input_shape= and num_classes=")
  class_names = list(class_names or [f"class_{i}"
                                     for i in range(num_classes)])
  if len(class_names) != num_classes:
    raise ConfigError(f"class_names has {len(class_names)} names for "
                      f"num_classes={num_classes}")
  info = {"model": path,
          "model_import_dir": registry.import_dir(path),
          "model_options": dict(model_options or {}),
          "input_shape": [int(d) for d in input_shape],
          "num_classes": int(num_classes),
          "class_names": class_names,
          "dataset": dataset, "data_dir": data_dir,
          "dataset_options": dict(dataset_options or {}),
          "global_batch_size": global_batch_size, "seed": seed,
          "input_preprocessing": preprocessing.CONTRACT,
          # `build_model` built it as it is, with no wrapper in front.
          input_scale.RECORD: False,
          "trained_by": "Controller",
          **data_sources(
              None if dataset else "custom", None if dataset else "custom")}
  write_model_info(model_dir, info)
  return info
