"""The data layer's settings: how batches are made, and dataset options.

TensorFlow-free (`framework.settings`), so that `scripts/config_flags.py`
makes flags from it before TensorFlow loads.
"""

import dataclasses
import math
import os

from framework import settings
from framework.errors import ConfigError
from framework.settings import POSITIVE, check_settings, setting

# global: experimental_distribute_dataset; per_replica:
# distribute_datasets_from_function (see `inputs`).
INPUT_MODES = ("global", "per_replica")
AUGMENTATIONS = ("none", "flip", "crop_flip")
# How a dataset streamed from files is shuffled (see `file_input`).
SHUFFLES = ("shards", "global")
# The loader registered for `tfds:NAME[:VERSION]`.
TFDS_PREFIX = "tfds:"
# The datasets `datasets.load_dataset` registers (fnmatch patterns; the
# `read_by` tables of the settings speak of these).
DATASET_NAMES = ("cifar10", "synthetic", "shapes", "oxford_pet", "text",
                 "tfrecord", "image_folder", "numpy", "mix", TFDS_PREFIX + "*")
# The datasets whose global batch at a step is a function of (seed, step,
# global batch) alone, whatever the worker count (in-memory or mapped
# arrays, `framework.data.inputs`): a job may shrink on them (`launch.py
# --min_workers`) and go on with the same sequence of examples. The others
# read their files per worker (`framework.data.shard_order.plan`).
RESIZABLE_DATASETS = ("cifar10", "synthetic", "shapes", "oxford_pet", "numpy")
# `--dataset=mix`: a weighted mixture of the datasets its `--mix` names.
MIX = "mix"
MIX_FORM = "[LABEL=]DATASET:WEIGHT"
_TFDS = TFDS_PREFIX + "*"


@dataclasses.dataclass(frozen=True)
class InputConfig:
  """How the training batches are drawn: the run's seed and input mode.

  Declared here, in the lowest layer that reads them: the data layer's
  keywords (`inputs.distribute_train`, `datasets.load_dataset`, ...)
  default to these fields (`settings.default(InputConfig, "seed")`), and
  the run's config declares the same settings.
  """
  seed: int = setting(0, "Seed for weights, data order and augmentation.")
  input_mode: str = setting(
      "global", "global: experimental_distribute_dataset; per_replica: "
      "distribute_datasets_from_function.", choices=INPUT_MODES)

  def __post_init__(self):
    check_settings(self)


@dataclasses.dataclass(frozen=True)
class DatasetOptions:
  """The options `datasets.load_dataset` passes to the dataset loaders.

  `for_dataset(name)` is the dict a run records as its `dataset_options`:
  only the options that dataset's loader takes.
  """
  image_size: int = setting(
      128, "shapes, oxford_pet: side of the square images (tfds: of images "
      "without a fixed size).", minimum=POSITIVE,
      read_by={"dataset": ("shapes", "oxford_pet", _TFDS)})
  label_key: str = setting(
      "label", "tfds: the feature used as label: a ClassLabel, or an image "
      "mask (e.g. segmentation_mask).", read_by={"dataset": (_TFDS,)})
  image_key: str = setting("image", "tfds: the image feature.",
                           read_by={"dataset": (_TFDS,)})
  file_shuffle: str = setting(
      "shards", "Streamed datasets: 'shards' shuffles groups of 4 shards "
      "(memory: a few shards); 'global' orders each epoch as the in-memory "
      "arrays are (on one worker the very same batches; memory: the "
      "encoded training split).", choices=SHUFFLES,
      read_by={"dataset": ("tfrecord", "image_folder", _TFDS)})
  sequence_length: int = setting(
      128, "text: tokens (bytes) per example; targets are the next bytes.",
      minimum=POSITIVE, read_by={"dataset": ("text", MIX)})
  mix: tuple[str, ...] = setting(
      (), "dataset=mix: its sources and weights, " + MIX_FORM + ",... (e.g. "
      "code=text:0.7,prose=text:0.3): any registered dataset, named by "
      "LABEL (default: the dataset's name); weights are relative, each "
      "example is drawn from a source in these proportions.",
      read_by={"dataset": (MIX,)})
  mix_data_dirs: tuple[str, ...] = setting(
      (), "dataset=mix: each source's data_dir, NAME:DIR,... (NAME as in "
      "--mix; a source not listed gets its dataset's default).",
      read_by={"dataset": (MIX,)})

  def __post_init__(self):
    check_settings(self)
    sources = mix_sources(self.mix)
    dirs = mix_dirs(self.mix_data_dirs, [s.name for s in sources])
    # Absolute once, as --data_dir: a run's record means the same folders
    # from any other folder.
    object.__setattr__(self, "mix_data_dirs", tuple(
        f"{name}:{path}" for name, path in dirs.items()))

  def for_dataset(self, name):
    """{option: value} for dataset `name` (tfds keys only for tfds:...,
    file_shuffle only when not the default)."""
    options = {"image_size": self.image_size}
    if name.startswith(TFDS_PREFIX):
      options.update(image_key=self.image_key, label_key=self.label_key)
    if name in ("text", MIX):
      options["sequence_length"] = self.sequence_length
    if name == MIX:
      options.update(mix=self.mix, mix_data_dirs=self.mix_data_dirs)
    if self.file_shuffle != "shards":
      options["file_shuffle"] = self.file_shuffle
    return options


def read_options(name, options):
  """The entries of a run's `dataset_options` that dataset `name`'s loader
  reads (what `model_info.json` records): `image_size` only for the
  datasets it sizes, not for numpy or cifar10. Keys that are not
  `DatasetOptions` fields are kept."""
  fields = {f.name: f for f in dataclasses.fields(DatasetOptions)}
  return {k: v for k, v in options.items()
          if k not in fields or settings.is_read(
              settings.info(fields[k])["read_by"], {"dataset": name},
              {"dataset": DATASET_NAMES})}


@dataclasses.dataclass(frozen=True)
class MixSource:
  """One `--mix` entry: a registered dataset under a name, its weight."""
  name: str
  dataset: str
  weight: float


def mix_sources(entries):
  """The `MixSource`s of `--mix` entries ([LABEL=]DATASET:WEIGHT); one
  ConfigError naming the entry for a weight that is not a positive number,
  a malformed or repeated name."""
  if isinstance(entries, str):
    entries = [e for e in entries.split(",") if e]
  sources = []
  for entry in entries:
    head, sep, weight_text = str(entry).rpartition(":")
    label, eq, dataset = head.partition("=")
    if not eq:
      label, dataset = head, head
    if not sep or not label or not dataset:
      raise ConfigError(f"mix={entry!r} must be {MIX_FORM} (e.g. "
                        "code=text:0.7 or text:1)")
    try:
      weight = float(weight_text)
    except ValueError:
      weight = math.nan
    if not (math.isfinite(weight) and weight > 0):
      raise ConfigError(f"mix={entry!r}: the weight {weight_text!r} must be "
                        "a positive number (e.g. 0.3; weights are relative)")
    if dataset == MIX:
      raise ConfigError(f"mix={entry!r}: a mixture cannot hold dataset=mix")
    if label in [s.name for s in sources]:
      raise ConfigError(f"mix={entry!r}: the name {label!r} is given twice; "
                        "name sources of one dataset apart with LABEL= "
                        "(e.g. code=text:0.7,prose=text:0.3)")
    sources.append(MixSource(label, dataset, weight))
  return tuple(sources)


def mix_dirs(entries, names):
  """{source name: absolute data_dir} of `--mix_data_dirs` entries
  (NAME:DIR); ConfigError for a malformed entry or a NAME not in `names`."""
  if isinstance(entries, str):
    entries = [e for e in entries.split(",") if e]
  dirs = {}
  for entry in entries:
    name, sep, path = str(entry).partition(":")
    if not sep or not path:
      raise ConfigError(f"mix_data_dirs={entry!r} must be NAME:DIR")
    if name not in names:
      raise ConfigError(
          f"mix_data_dirs={entry!r}: {name!r} is no source of --mix (its "
          f"sources: {', '.join(names) or 'none'})")
    if name in dirs:  # else the later folder would win silently
      raise ConfigError(f"mix_data_dirs={entry!r}: the source {name!r} is "
                        "given a folder twice; give each source one NAME:DIR")
    if "://" not in path:
      path = os.path.abspath(os.path.expanduser(path))
    dirs[name] = path
  return dirs
