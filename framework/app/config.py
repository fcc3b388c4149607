"""The run's settings: `ExperimentConfig`.

Each field is a setting written once (`framework.settings.setting`): its
default, help text, choices and checks. `scripts/config_flags.py` makes the
flags of `scripts/train.py` from these fields and the nested configs
(`OptimizerConfig`, `LoopConfig`, `ModelParallelConfig`, the built-in
models' `models.options.ModelOptions`, `DatasetOptions`); a new setting is
one new field. No TensorFlow here: the flags exist before TensorFlow loads.
"""

import dataclasses
import os
import re

from framework.core.config import (NAN_POLICIES, PRECISION_CHOICES,
                                   RESTORE_POLICIES, TTA_MODES,
                                   AllReduceConfig, LoopConfig,
                                   OptimizerConfig, TrainerConfig)
from framework.data.config import (AUGMENTATIONS, INPUT_MODES,
                                   DatasetOptions)
from framework.distribute.choices import STRATEGIES
from framework.app import eval_set_specs
from framework.core.stop_condition import StopCondition, parse_metric
from framework.errors import ConfigError
from framework.model_parallel.config import ModelParallelConfig
from framework.settings import (POSITIVE, all_but, check_settings, same_as,
                                setting)
# The built-in models' options live beside the models (no TensorFlow:
# `models` loads its builders when first asked for one).
from models import options as builtin_options

# The built-in models (models/); `read_by` tables speak of these, and a
# model of one's own (package.module:function) counts as reading any option.
BUILTIN_MODELS = ("cifar_cnn", "mlp", "unet", "gpt")


# Where `shard_optimizer_state` applies: the data-parallel strategies whose
# update the trainer owns (one replica: nothing to shard, a note).
SHARDING_STRATEGIES = ("default", "one_device", "mirrored",
                       "multi_worker_mirrored")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything a run needs; `scripts/train.py` fills it from flags.

  Exactly one of `train_steps` and `epochs` is set. `mixed_precision` may
  be `auto` (`precision.resolve_precision`: bfloat16 where the hardware
  computes it natively). `label_smoothing`, `ema_decay`, `ema_warmup` and
  `eval_tta` go to the Trainer (see `Trainer`); with an EMA, evaluation,
  model.weights.h5 and the SavedModel use the averaged weights, the
  checkpoints keep the raw ones (and the EMA), and model.raw.weights.h5
  the raw final weights. `model_options` go to the model's builder (the
  ones its signature takes), `dataset_options` to the dataset's loader.
  """
  model: str = setting("cifar_cnn", "Model name (see models/), the import "
                       "path package.module:function of a builder, or "
                       "keras.applications:NAME.", key=True)
  dataset: str = setting(
      "cifar10", "cifar10, synthetic, shapes (generated segmentation) or "
      "oxford_pet (in memory); text (byte-level language modelling: "
      "--data_dir of text files, default the Python standard library's "
      "sources); tfrecord (--data_dir written by "
      "make_tfrecords.py), image_folder (--data_dir/<class>/*.png|jpg), "
      "tfds:NAME[:VERSION] (prepared under --data_dir; pip install -e "
      '".[tfds]") or numpy (--data_dir: an .npz, or a folder of .npy, of '
      "x_train, y_train, x_test, y_test [, class_names]: x numbers "
      "[examples, ...], uint8 divided by 255, other dtypes as given; y "
      "integer class indices [examples]), streamed.", key=True)
  data_dir: str | None = setting(
      None, "CIFAR-10 python directory (default: Keras's cache, "
      "~/.keras/datasets/cifar-10-batches-py) or the Oxford-IIIT Pet "
      "directory.", read_by={"dataset": all_but("synthetic", "shapes")})
  model_dir: str = setting("/tmp/distloop", "Checkpoints, TensorBoard "
                           "(train/, eval/) and the final weights.")
  strategy: str = setting("default", "tf.distribute strategy.",
                          choices=STRATEGIES, key=True)
  tpu: str | None = setting(None, "TPU name or grpc://host:port for "
                            "--strategy=tpu.",
                            read_by={"strategy": ("tpu",)})
  global_batch_size: int = setting(128, "Examples per step, all replicas "
                                   "together.", minimum=POSITIVE, key=True)
  train_steps: int | None = setting(
      None, "Global steps (or --epochs); 0 unsets it, e.g. to override a "
      "flag file's --epochs.", zero_unsets=True, minimum=POSITIVE,
      key=True)
  epochs: int | None = setting(
      None, "Epochs (or --train_steps); 0 unsets it, e.g. to override a "
      "flag file's --train_steps.", zero_unsets=True, minimum=POSITIVE,
      key=True)
  optimizer: OptimizerConfig = OptimizerConfig()
  clip_norm: float | None = same_as(TrainerConfig, "clip_norm")
  nan_policy: str = same_as(TrainerConfig, "nan_policy")
  max_skipped_steps: int = same_as(TrainerConfig, "max_skipped_steps")
  # train_steps filled in by `experiment.build_model_and_optimizer`.
  loop: LoopConfig | None = None
  seed: int = setting(0, "Seed for weights, data order and augmentation.")
  deterministic: bool = setting(True, "Deterministic TensorFlow ops (exact "
                                "resume).")
  input_mode: str = setting(
      "global", "global: experimental_distribute_dataset; per_replica: "
      "distribute_datasets_from_function.", choices=INPUT_MODES)
  grad_accum_steps: int = same_as(TrainerConfig, "grad_accum_steps")
  mixed_precision: str = setting(
      "float32", "Compute dtype (float32 variables); float16 uses dynamic "
      "loss scaling; auto: bfloat16 on CPUs with AVX512_BF16/AMX-BF16 or "
      "GPUs with native bfloat16, else float32 (logged).",
      choices=PRECISION_CHOICES, key=True)
  augment: str = setting("none", "Training augmentation: crop_flip = "
                         "4-pixel random crop + horizontal flip.",
                         choices=AUGMENTATIONS)
  model_options: dict = setting(
      help="More options for the model's builder as key=value,... (a list "
      "value continues after commas: hidden_units=32,16,dropout=false), "
      "typed from its signature; they override the flags of the built-in "
      "options.", default_factory=dict,
      options=builtin_options.ModelOptions,
      free_form=True)
  dataset_options: dict = setting(default_factory=dict, flag=False,
                                  options=DatasetOptions)
  export_saved_model: bool = setting(
      True, "At the end, also write a SavedModel with a serving signature to "
      "<model_dir>/export (the weights file is always written).")
  # What TensorBoard shows as the run's settings (`scripts/config_flags.py`
  # fills it: the key ones and those that differ from their defaults).
  hparams: dict = dataclasses.field(default_factory=dict)
  check_distribution: bool = setting(
      False, "Before training, run one step under --strategy and on one "
      "device from the same state and compare (exits 1 if the step is wrong "
      "when distributed); run it first after writing a custom step.")
  model_parallel: ModelParallelConfig = ModelParallelConfig()
  restore: str = setting(
      "latest_intact", "A damaged newest checkpoint: latest_intact = warn "
      "and resume from the newest intact one; error = stop.",
      choices=RESTORE_POLICIES)
  allow_config_change: bool = setting(
      False, "Resume although --model, its options, --optimizer, "
      "--global_batch_size or --dataset differ from the checkpoint's (e.g. "
      "fine-tuning); otherwise that is an error.")
  label_smoothing: float = setting(0.0, "Label smoothing of the "
                                   "cross-entropy, in [0, 1).")
  ema_decay: float | None = same_as(TrainerConfig, "ema_decay")
  ema_warmup: bool = same_as(TrainerConfig, "ema_warmup")
  eval_tta: str = same_as(TrainerConfig, "eval_tta")
  # The gradient all-reduce's packing, implementation and wire dtype.
  all_reduce: AllReduceConfig = same_as(TrainerConfig, "all_reduce")
  jit_compile: bool = same_as(TrainerConfig, "jit_compile")
  init_checkpoint: str | None = setting(
      None, "Warm start the model's weights (not the optimizer, step or data "
      "position) from a run folder (its newest checkpoint; <run>/best for "
      "its best), a folder or prefix of a TF checkpoint, or a Keras "
      ".weights.h5 file; only when --model_dir has no checkpoint of its own "
      "(a relaunch resumes).")
  init_skip_mismatch: bool = setting(
      False, "--init_checkpoint: keep the fresh values of variables the "
      "source lacks or has in another shape (a new head), logged by name; "
      "otherwise those are an error.")
  init_exclude: str | None = setting(
      None, "--init_checkpoint: a regular expression; model variables whose "
      "Keras path (e.g. mlp/dense_2/kernel) it matches keep their fresh "
      "values.")
  shard_optimizer_state: bool = same_as(TrainerConfig, "shard_optimizer_state")
  eval_sets: tuple[str, ...] = setting(
      (), "More eval sets, evaluated at every evaluation into "
      "model_dir/eval_<NAME>: NAME:DATASET[:DATA_DIR[:SPLIT]] (SPLIT test or "
      "train), several separated by commas, e.g. "
      "test:cifar10:data/cifar10-test; --stop_when, --stop_at_accuracy and "
      "--best_metric can name them as eval_<NAME>/<metric>.")

  def __post_init__(self):
    if not self.model_dir:
      raise ConfigError(f"model_dir={self.model_dir!r} must be a directory "
                        "path")
    # Resolved once, here: what the run records (model_info.json, the
    # checkpoint state) then means the same folder from any other folder.
    for name in ("model_dir", "data_dir", "init_checkpoint"):
      object.__setattr__(self, name, absolute_path(getattr(self, name)))
    check_settings(self)
    if (self.train_steps is None) == (self.epochs is None):
      both = self.train_steps is not None
      raise ConfigError(
          "set exactly one of train_steps and epochs (got "
          f"train_steps={self.train_steps}, epochs={self.epochs})" + (
              "; 0 unsets either, e.g. --train_steps=N --epochs=0 over a "
              "flag file's --epochs" if both else ""))
    if self.init_exclude:
      try:
        re.compile(self.init_exclude)
      except re.error as e:
        raise ConfigError(f"init_exclude={self.init_exclude!r} is not a "
                          f"regular expression ({e})") from None
    if self.label_smoothing:
      from framework.core import losses  # pylint: disable=g-import-not-at-top
      losses.smoothed_sparse_categorical_loss(self.label_smoothing)  # checks
    TrainerConfig.of(self)  # checks the trainer's settings
    builtin = builtin_options.ModelOptions
    self.model_parallel.check_model(
        self.model, self.model_options.get("num_heads", builtin.num_heads),
        self.model_options.get("vocab_size", builtin.vocab_size),
        self.model_options.get("num_layers", builtin.num_layers))
    if self.shard_optimizer_state:
      self._check_sharding()
    self._check_eval_splits()
    if self.model_parallel.mode != "none" and (
        self.ema_decay is not None or self.eval_tta != "none"):
      raise ConfigError(
          f"ema_decay and eval_tta are not supported with model_parallel="
          f"{self.model_parallel.mode}")

  def _check_sharding(self):
    """`shard_optimizer_state` needs a data axis whose update the trainer
    owns: (multi-worker) mirrored replicas, or a split's copies (a mesh's
    data axis, or mirrored devices cut into copies of the split)."""
    split = self.model_parallel
    if self.strategy not in SHARDING_STRATEGIES:
      raise ConfigError(
          f"shard_optimizer_state=True needs the trainer's data-parallel "
          f"update ({', '.join(SHARDING_STRATEGIES)}, or a mesh with a data "
          f"axis), not strategy={self.strategy}")
    if (split.mode == "none" or split.data_axis > 1 or
        self.strategy == "mirrored"):
      return
    if split.mesh:
      where, mesh = f"mesh={split.mesh}", split.mesh
    else:
      where = f"model_parallel={split.mode} with strategy={self.strategy}"
      mesh = (f"pipeline:{split.num_stages}" if split.mode == "pipeline"
              else f"model:{split.num_shards}")
    raise ConfigError(
        f"shard_optimizer_state=True shards the optimizer state over a data "
        f"axis; {where} has none (use a mesh with one, e.g. "
        f"--mesh=data:2,{mesh}, or turn shard_optimizer_state off)")

  def _check_eval_splits(self):
    """`best_metric` and `stop_when` name eval sets this run has."""
    loop = self.loop or LoopConfig(train_steps=1)
    splits = {"eval"} | {f"eval_{spec.name}" for spec in
                         eval_set_specs.parse_all(self.eval_sets)}
    named = {"best_metric": loop.best_metric and parse_metric(
        loop.best_metric)[0], "stop_when": loop.stop_when and
             StopCondition.parse(loop.stop_when).split}
    for name, split in named.items():
      if split and split != "train" and split not in splits:
        raise ConfigError(
            f"{name}={getattr(loop, name)!r} names the eval set "
            f"{split[len('eval_'):]!r}, which this run does not have (its "
            f"eval splits: {', '.join(sorted(splits))}; add one with "
            "eval_sets)")


def absolute_path(path):
  """`path` with `~` expanded, made absolute (URLs such as gs://... and
  None unchanged)."""
  if not isinstance(path, str) or not path or "://" in path:
    return path
  return os.path.abspath(os.path.expanduser(path))


def __getattr__(name):
  """`ModelOptions`, moved to `models.options`: still importable from here,
  with a DeprecationWarning."""
  if name == "ModelOptions":
    import warnings  # pylint: disable=g-import-not-at-top
    warnings.warn("framework.app.config.ModelOptions moved to "
                  "models.options.ModelOptions", DeprecationWarning,
                  stacklevel=2)
    return builtin_options.ModelOptions
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
