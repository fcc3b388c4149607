"""More eval sets from the command line: `--eval_sets=NAME:DATASET[:DATA_DIR[:SPLIT]]`.

    --eval_sets=test:cifar10:data/cifar10-test
    --eval_sets=holdout:tfrecord:data/holdout,train:synthetic::train

NAME names the folder `eval_<NAME>/`; DATASET is any `--dataset` value
(`tfds:NAME[:VERSION]` included: a version is the field of digits and dots
after the name); DATA_DIR that dataset's `--data_dir` (empty: its
default); SPLIT `test` (the default) or `train` (the training split of an
in-memory dataset, evaluated as a test split). Several sets are separated
by commas. Each set is read with the run's seed and global batch and must
have the run's input shape and classes.

TensorFlow-free: `ExperimentConfig` checks the specs before TensorFlow
loads; `eval_inputs` (which loads the data) imports it.
"""

import dataclasses
import os
import re

from framework.errors import ConfigError, DistloopError

SPLITS = ("test", "train")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_VERSION = re.compile(r"\d+(\.\d+)*")
FORM = "NAME:DATASET[:DATA_DIR[:SPLIT]]"


@dataclasses.dataclass(frozen=True)
class EvalSetSpec:
  """One `--eval_sets` entry."""
  name: str
  dataset: str
  data_dir: str | None = None
  split: str = "test"


def parse(text: str) -> EvalSetSpec:
  """`text` (NAME:DATASET[:DATA_DIR[:SPLIT]]) as a spec; ConfigError
  naming eval_sets otherwise."""
  fields = text.split(":") if isinstance(text, str) else []
  if len(fields) >= 3 and fields[1] == "tfds":
    # tfds:NAME[:VERSION] is one dataset field.
    take = 4 if len(fields) > 3 and _VERSION.fullmatch(fields[3]) else 3
    fields = [fields[0], ":".join(fields[1:take])] + fields[take:]
  if not 2 <= len(fields) <= 4 or not fields[1]:
    raise ConfigError(f"eval_sets={text!r} must be {FORM} (e.g. "
                      "test:cifar10:data/cifar10, holdout:synthetic)")
  name, dataset = fields[0], fields[1]
  data_dir = fields[2] if len(fields) > 2 and fields[2] else None
  split = fields[3] if len(fields) > 3 else "test"
  if not _NAME.fullmatch(name) or name in ("eval", "standalone"):
    raise ConfigError(
        f"eval_sets={text!r}: the name {name!r} must be letters, digits, _ "
        "and - (it names the folder eval_<name>), not eval or standalone")
  if split not in SPLITS:
    raise ConfigError(f"eval_sets={text!r}: split {split!r} must be one of "
                      f"{', '.join(SPLITS)}")
  if data_dir is not None and "://" not in data_dir:
    data_dir = os.path.abspath(os.path.expanduser(data_dir))
  return EvalSetSpec(name, dataset, data_dir, split)


def parse_all(texts) -> tuple[EvalSetSpec, ...]:
  """Every spec, names unique; ConfigError otherwise."""
  specs = tuple(parse(t) for t in texts)
  names = [s.name for s in specs]
  for name in names:
    if names.count(name) > 1:
      raise ConfigError(f"eval_sets names {name!r} twice; each set needs a "
                        "name of its own")
  return specs


def eval_inputs(config, strategy, dataset, eval_input=None):
  """{name: `() -> dataset`} for the Controller: the run's own set (`eval`,
  `eval_input` or `dataset`'s test split) and `config.eval_sets`, each
  limited to `config.loop.eval_steps` global batches if that is set."""
  from framework.core import evaluation  # pylint: disable=g-import-not-at-top
  from framework.data import datasets, inputs  # pylint: disable=g-import-not-at-top
  steps = config.loop.eval_steps if config.loop else None
  batch = config.global_batch_size
  found = {"eval": eval_input or (lambda: _distributed(
      evaluation, inputs, strategy, dataset, batch, "test", steps))}
  for spec in parse_all(config.eval_sets):
    try:
      other = datasets.load_dataset(spec.dataset, spec.data_dir,
                                    seed=config.seed,
                                    **config.dataset_options)
    except DistloopError as e:
      # Which flag named the data: the main dataset loaded fine.
      raise type(e)(f"eval_sets={spec.name}:{spec.dataset}: {e}") from None
    _check_fits(spec, other, dataset)
    found[spec.name] = (lambda other=other, spec=spec: _distributed(
        evaluation, inputs, strategy, other, batch, spec.split, steps))
  return found


def check_parameter_server(config):
  """ConfigError if `config` asks for what a parameter-server run's own
  evaluation (on the coordinator, `ps_training`) does not do."""
  for name, value in (("eval_sets", config.eval_sets),
                      ("eval_steps", config.loop and config.loop.eval_steps)):
    if value:
      raise ConfigError(f"{name}={value!r} is not supported under "
                        "strategy=parameter_server (its coordinator "
                        "evaluates the run's own test split)")


def _check_fits(spec, other, dataset):
  if list(other.input_shape) != list(dataset.input_shape):
    raise ConfigError(
        f"eval_sets={spec.name}:{spec.dataset}: inputs of shape "
        f"{tuple(other.input_shape)}; the run trains on "
        f"{tuple(dataset.input_shape)}")
  ours, theirs = (getattr(d, "num_classes", None) for d in (dataset, other))
  if ours is not None and theirs is not None and ours != theirs:
    raise ConfigError(f"eval_sets={spec.name}:{spec.dataset}: {theirs} "
                      f"classes; the run trains on {ours}")
  if spec.split == "train" and not hasattr(other, "train_x"):
    raise ConfigError(f"eval_sets={spec.name}:{spec.dataset}:...:train: "
                      "split=train needs an in-memory dataset (this one "
                      "streams its test split only)")


def _distributed(evaluation, inputs, strategy, dataset, batch, split, steps):
  """One pass over `dataset`'s `split`, padded, at most `steps` batches."""
  if split == "train" or steps is not None:
    if hasattr(dataset, "eval_dataset_fn"):  # streamed from files
      fn = dataset.eval_dataset_fn(batch)
      return evaluation.Distributed(strategy.distribute_datasets_from_function(
          lambda context: fn(context).take(steps)), steps)
    if hasattr(dataset, "eval_dataset"):
      return dataset.eval_dataset(batch)
    x, y = ((dataset.train_x, dataset.train_y) if split == "train"
            else (dataset.test_x, dataset.test_y))
    return inputs.eval_dataset(x, y, batch)  # the Controller cuts it
  return inputs.distribute_test(strategy, dataset, batch)
