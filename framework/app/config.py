"""The run's settings: `ExperimentConfig` and the built-in models' options.

Each field is a setting written once (`framework.settings.setting`): its
default, help text, choices and checks. `scripts/config_flags.py` makes the
flags of `scripts/train.py` from these fields and the nested configs
(`OptimizerConfig`, `LoopConfig`, `ModelParallelConfig`, `ModelOptions`,
`DatasetOptions`); a new setting is one new field. No TensorFlow here: the
flags exist before TensorFlow loads.
"""

import dataclasses
import os

from framework.core.config import (NAN_POLICIES, PRECISION_CHOICES,
                                   RESTORE_POLICIES, TTA_MODES,
                                   AllReduceConfig, LoopConfig,
                                   OptimizerConfig)
from framework.data.config import (AUGMENTATIONS, INPUT_MODES,
                                   DatasetOptions)
from framework.distribute.choices import STRATEGIES
from framework.errors import ConfigError
from framework.model_parallel.config import ModelParallelConfig
from framework.settings import POSITIVE, check_settings, setting


@dataclasses.dataclass(frozen=True)
class ModelOptions:
  """The options of the built-in models (`ExperimentConfig.model_options`).

  A model's builder gets the ones its signature names; a model of one's own
  gets its options from `--model_options=key=value,...` (typed from its
  signature, see `models.registry.parse_options`).
  """
  hidden_units: tuple[int, ...] = setting((64, 64),
                                          "mlp: hidden layer sizes.")
  dropout: bool = setting(True, "cifar_cnn: keep the Dropout layers.")
  sync_batch_norm: bool = setting(
      False, "BatchNorm statistics over all replicas (Keras "
      "synchronized=True).")
  depth: int = setting(4, "unet: down-sampling levels.", flag="unet_depth",
                       minimum=POSITIVE)
  width: int = setting(32, "unet: filters of the first level.",
                       flag="unet_width", minimum=POSITIVE)
  num_layers: int = setting(2, "gpt: transformer blocks.", minimum=POSITIVE)
  num_heads: int = setting(4, "gpt: attention heads per block (must divide "
                           "--model_width).", minimum=POSITIVE)
  model_width: int = setting(128, "gpt: embedding width.", minimum=POSITIVE)
  vocab_size: int = setting(0, "gpt: vocabulary; 0: the dataset's (256 byte "
                            "tokens for --dataset=text).")
  tie_embeddings: bool = setting(True, "gpt: the output head is the token "
                                 "embedding table (tied), else its own.")

  def __post_init__(self):
    check_settings(self)


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
  model: str = setting("cifar_cnn", "Model name (see models/) or the import "
                       "path package.module:function of a builder.", key=True)
  dataset: str = setting(
      "cifar10", "cifar10, synthetic, shapes (generated segmentation) or "
      "oxford_pet (in memory); text (byte-level language modelling: "
      "--data_dir of text files, default the Python standard library's "
      "sources); tfrecord (--data_dir written by "
      "make_tfrecords.py), image_folder (--data_dir/<class>/*.png|jpg) or "
      "tfds:NAME[:VERSION] (prepared under --data_dir; pip install -e "
      '".[tfds]"), streamed.', key=True)
  data_dir: str | None = setting(
      None, "CIFAR-10 python directory (default: Keras's cache, "
      "~/.keras/datasets/cifar-10-batches-py) or the Oxford-IIIT Pet "
      "directory.")
  model_dir: str = setting("/tmp/distloop", "Checkpoints, TensorBoard "
                           "(train/, eval/) and the final weights.")
  strategy: str = setting("default", "tf.distribute strategy.",
                          choices=STRATEGIES, key=True)
  tpu: str | None = setting(None, "TPU name or grpc://host:port for "
                            "--strategy=tpu.")
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
  clip_norm: float | None = setting(None, "Clip the all-reduced gradient to "
                                    "this global norm.")
  nan_policy: str = setting(
      "stop", "On a NaN/Inf loss: stop (keep the last good checkpoint) or "
      "skip the step.", choices=NAN_POLICIES)
  max_skipped_steps: int = setting(
      10, "--nan_policy=skip: stop with an error (saving nothing) after this "
      "many skipped steps in a row.", minimum=POSITIVE)
  # train_steps filled in by `experiment.build_model_and_optimizer`.
  loop: LoopConfig | None = None
  seed: int = setting(0, "Seed for weights, data order and augmentation.")
  deterministic: bool = setting(True, "Deterministic TensorFlow ops (exact "
                                "resume).")
  input_mode: str = setting(
      "global", "global: experimental_distribute_dataset; per_replica: "
      "distribute_datasets_from_function.", choices=INPUT_MODES)
  grad_accum_steps: int = setting(
      1, "Split each replica's batch into this many micro-batches; one "
      "all-reduce and update per step (same update, less activation "
      "memory).", minimum=POSITIVE)
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
      "options.", default_factory=dict, options=ModelOptions,
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
  ema_decay: float | None = setting(
      None, "Keep an exponential moving average of the weights with this "
      "decay (e.g. 0.99); evaluation and model.weights.h5 / the SavedModel "
      "use it (model.raw.weights.h5: the raw weights); 0 unsets it, e.g. to "
      "override a flag file's.", zero_unsets=True)
  ema_warmup: bool = setting(
      False, "EMA decay min(ema_decay, (1+n)/(10+n)) at update n: forgets "
      "the initial weights quickly in short runs.")
  eval_tta: str = setting(
      "none", "Test-time augmentation in evaluation: flip averages the "
      "logits of each image and its horizontal mirror.", choices=TTA_MODES)
  # The gradient all-reduce's packing, implementation and wire dtype.
  all_reduce: AllReduceConfig = AllReduceConfig()

  def __post_init__(self):
    if not self.model_dir:
      raise ConfigError(f"model_dir={self.model_dir!r} must be a directory "
                        "path")
    # Resolved once, here: what the run records (model_info.json, the
    # checkpoint state) then means the same folder from any other folder.
    for name in ("model_dir", "data_dir"):
      object.__setattr__(self, name, absolute_path(getattr(self, name)))
    check_settings(self)
    if (self.train_steps is None) == (self.epochs is None):
      raise ConfigError("set exactly one of train_steps and epochs (got "
                        f"train_steps={self.train_steps}, "
                        f"epochs={self.epochs})")
    if self.label_smoothing:
      from framework.core import losses  # pylint: disable=g-import-not-at-top
      losses.smoothed_sparse_categorical_loss(self.label_smoothing)  # checks
    if self.ema_decay is not None and not 0 < self.ema_decay < 1:
      raise ConfigError(f"ema_decay={self.ema_decay} must be in (0, 1) (or "
                        "unset)")
    self.model_parallel.check_model(
        self.model, self.model_options.get("num_heads", ModelOptions.num_heads),
        self.model_options.get("vocab_size", 0))
    if self.model_parallel.mode != "none" and (
        self.ema_decay is not None or self.eval_tta != "none"):
      raise ConfigError(
          f"ema_decay and eval_tta are not supported with model_parallel="
          f"{self.model_parallel.mode}")


def absolute_path(path):
  """`path` with `~` expanded, made absolute (URLs such as gs://... and
  None unchanged)."""
  if not isinstance(path, str) or not path or "://" in path:
    return path
  return os.path.abspath(os.path.expanduser(path))
