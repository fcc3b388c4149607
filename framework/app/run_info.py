"""`describe_run`: the record that makes your own Controller's run readable
by `evaluate.py`, `predict.py` and the export.

`framework.run` (and `train.py`) write `model_dir/model_info.json` when
training starts. A loop you drive yourself (`framework.Controller`) writes
checkpoints the scripts can restore, but only you know how its model is
built and which data it learned from; one call says so:

    framework.describe_run("runs/mine", my_nets.build, dataset="numpy",
                           data_dir="data.npz", model_options={"width": 64})

`build_model` must be a module-level `build(input_shape, num_classes,
**options)` (the scripts import it again). With a `dataset` (any
`--dataset` name, with its `data_dir`), the scripts evaluate on its test
split; without one, give `input_shape` and `num_classes`, and the scripts
ask for `--dataset`/`--data_dir` instead of guessing.
"""

from typing import Callable, Optional, Sequence

from models import registry
from framework.app import custom_inputs, export
from framework.data import datasets, preprocessing
from framework.errors import ConfigError


def describe_run(model_dir: str, build_model: Callable, *,
                 dataset: Optional[str] = None,
                 data_dir: Optional[str] = None,
                 input_shape: Optional[Sequence[int]] = None,
                 num_classes: Optional[int] = None,
                 class_names: Optional[Sequence[str]] = None,
                 model_options: Optional[dict] = None,
                 dataset_options: Optional[dict] = None,
                 global_batch_size: Optional[int] = None,
                 seed: int = 0) -> dict:
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
          "trained_by": "Controller",
          **custom_inputs.record(
              None if dataset else "custom", None if dataset else "custom")}
  export.write_model_info(model_dir, info)
  return info
