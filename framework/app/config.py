"""The apps' settings, each declared once: what a run, an evaluation and a
prediction read.

    ExperimentConfig   scripts/train.py (`framework.run`); its `--eval_sets`
                       entries are `EvalSetSpec`s
    EvalConfig         scripts/evaluate.py (`evaluation`)
    PredictConfig      scripts/predict.py (`prediction`)

Each field is a setting written once (`framework.settings.setting`): its
default, help text, choices and checks. `scripts/config_flags.py` makes the
apps' flags from these fields and the nested configs (`OptimizerConfig`,
`LoopConfig`, `ModelParallelConfig`, the built-in models'
`models.options.ModelOptions`, `DatasetOptions`); a new setting is one new
field. No TensorFlow here: the flags exist before TensorFlow loads.
"""

import dataclasses
import os
import re

from framework.core.config import (PRECISION_CHOICES, RESTORE_POLICIES,
                                   AllReduceConfig, LoopConfig,
                                   OptimizerConfig, TrainerConfig)
from framework.core.config import (StopCondition, check_gradient_sharding,
                                   parse_metric)
from framework.data.config import AUGMENTATIONS, DatasetOptions, InputConfig
from framework.distribute.config import EVAL_STRATEGIES, STRATEGIES
from framework.errors import ConfigError
from framework.model_parallel.config import (ModelParallelConfig,
                                             layers_per_unit, parse_mesh,
                                             parse_recompute)
from framework.settings import (POSITIVE, all_but, check_settings, default,
                                same_as, setting)
# The built-in models' options live beside the models (no TensorFlow:
# `models` loads its builders when first asked for one).
from models import options as builtin_options

# --eval_sets=NAME:DATASET[:DATA_DIR[:SPLIT]]: more eval sets of a run.
#
#     --eval_sets=test:cifar10:data/cifar10-test
#     --eval_sets=holdout:tfrecord:data/holdout,train:synthetic::train
#
# NAME names the folder `eval_<NAME>/`; DATASET is any `--dataset` value
# (`tfds:NAME[:VERSION]` included: a version is the field of digits and
# dots after the name); DATA_DIR that dataset's `--data_dir` (empty: its
# default); SPLIT `test` (the default) or `train` (the training split of an
# in-memory dataset, evaluated as a test split). Several sets are separated
# by commas. Each set is read with the run's seed and global batch and must
# have the run's input shape and classes (`factory.eval_inputs`).
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
      "integer class indices [examples]), streamed; mix (a weighted mixture "
      "of these: --mix, --mix_data_dirs).", key=True)
  data_dir: str | None = setting(
      None, "CIFAR-10 python directory (default: Keras's cache, "
      "~/.keras/datasets/cifar-10-batches-py) or the Oxford-IIIT Pet "
      "directory.", read_by={"dataset": all_but("synthetic", "shapes", "mix")})
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
  spike_policy: str = same_as(TrainerConfig, "spike_policy")
  spike_factor: float = same_as(TrainerConfig, "spike_factor")
  spike_window: int = same_as(TrainerConfig, "spike_window")
  # train_steps filled in by `factory.build_model_and_optimizer`.
  loop: LoopConfig | None = None
  seed: int = same_as(InputConfig, "seed")
  deterministic: bool = setting(True, "Deterministic TensorFlow ops (exact "
                                "resume).")
  input_mode: str = same_as(InputConfig, "input_mode")
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
      "options. A model of one's own gets only the options set (flags "
      "given, --model_options); its own defaults stand otherwise.", default_factory=dict,
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
  shard_gradients: bool = same_as(TrainerConfig, "shard_gradients")
  shard_parameters: bool = setting(
      False, "With --shard_optimizer_state --shard_gradients: each replica "
      "also keeps only its 1/N of every weight (ZeRO-3): the model's "
      "top-level layers run in units (one layer, or K with "
      "--recompute=every:K) that all-gather their weights before their "
      "forward pass and again for their backward pass (each unit is "
      "recomputed), whose gradient is reduce-scattered. Mirrored and "
      "multi_worker_mirrored with 2 or more replicas, functional or "
      "Sequential models, no --ema_decay, --log_layer_norms or "
      "--jit_compile; on a model split, the copies on a mesh's data axis "
      "(--mesh=data:R,pipeline:S, or data:R,model:M for the GPT: each copy "
      "keeps 1/R of its stages' weights, each layer's joined on its device "
      "per call, forward and again backward). The model's variables keep "
      "the whole weights for "
      "checkpoints, evaluation and export, written from the shards after "
      "every --steps_per_loop steps; checkpoints are unchanged (a run "
      "resumes with it on or off and on another replica count).")
  weight_decay_exclude: str | None = same_as(TrainerConfig,
                                             "weight_decay_exclude")
  eval_sets: tuple[str, ...] = setting(
      (), "More eval sets, evaluated at every evaluation into "
      "model_dir/eval_<NAME>: NAME:DATASET[:DATA_DIR[:SPLIT]] (SPLIT test or "
      "train), several separated by commas, e.g. "
      "test:cifar10:data/cifar10-test; --stop_when, --stop_at_accuracy and "
      "--best_metric can name them as eval_<NAME>/<metric>.")
  # Appended last, so that the fields before them keep their positions.
  adapt_examples: int = setting(
      10000, "Training examples that the model's unadapted preprocessing "
      "layers (a keras Normalization) are adapted on, once, before a new "
      "run's first step (the first of its training batches, unaugmented); "
      "the checkpoints keep what they learn.", minimum=POSITIVE)
  log_layer_norms: bool = same_as(TrainerConfig, "log_layer_norms")

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
      from framework.core import trainer  # pylint: disable=g-import-not-at-top
      trainer.smoothed_sparse_categorical_loss(self.label_smoothing)  # checks
    TrainerConfig.of(self)  # checks the trainer's settings
    if (self.spike_policy == "rollback" and self.loop is not None
        and not self.loop.checkpoint_every):
      raise ConfigError(
          "spike_policy=rollback needs checkpoints to roll back to, but "
          "checkpoint_every=0 saves only at the end; set checkpoint_every "
          "(e.g. 100) or use spike_policy=skip")
    if (self.log_layer_norms and self.loop is not None
        and not self.loop.summary_every):
      # summary_every=0 records no summary inside the step: none would show.
      raise ConfigError(
          "log_layer_norms=True writes on the summary_every steps, but "
          "summary_every=0 records none; set summary_every (e.g. 100) or "
          "turn log_layer_norms off")
    if self.spike_policy != "none" and self.model_parallel.mode != "none":
      split = self.model_parallel
      where = (f"mesh={split.mesh}" if split.mesh
               else f"model_parallel={split.mode}")
      raise ConfigError(
          f"spike_policy={self.spike_policy} is not supported with {where} "
          "(a split's step applies its update without the spike check); "
          "use --spike_policy=none")
    builtin = builtin_options.ModelOptions
    self.model_parallel.check_model(
        self.model, self.model_options.get("num_heads", builtin.num_heads),
        self.model_options.get("vocab_size", builtin.vocab_size),
        self.model_options.get("num_layers", builtin.num_layers))
    if self.shard_optimizer_state:
      self._check_sharding()
    if self.shard_gradients:
      self._check_gradient_sharding()
    if self.shard_parameters:
      self._check_parameter_sharding()
    self._check_eval_splits()
    if self.dataset == "mix" and self.strategy == "parameter_server":
      # Asynchronous workers have no global step to position the mixture.
      raise ConfigError("dataset=mix is not supported with "
                        "strategy=parameter_server (a mixture resumes by "
                        "global step); use multi_worker_mirrored")
    self._check_checkpoint_sharding()
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
      # The example mesh is the user's with a data axis of 2 in place of
      # theirs (data:1 holds one copy: nothing to shard).
      sizes = parse_mesh(split.mesh)
      has = "a data axis of 1 (one copy)" if "data" in sizes else "none"
      where = f"mesh={split.mesh} has {has}"
      mesh = ",".join(f"{axis}:{size}" for axis, size in sizes.items()
                      if axis != "data")
    else:
      where = (f"model_parallel={split.mode} with strategy={self.strategy} "
               "has none")
      mesh = (f"pipeline:{split.num_stages}" if split.mode == "pipeline"
              else f"model:{split.num_shards}")
    raise ConfigError(
        f"shard_optimizer_state=True shards the optimizer state over a data "
        f"axis; {where} (use a mesh with one, e.g. "
        f"--mesh=data:2,{mesh}, or turn shard_optimizer_state off)")

  def _check_gradient_sharding(self):
    """`shard_gradients` (ZeRO-2) shards the gradients of ZeRO-1's update
    (over replicas, or over a split's copies on a mesh's data axis): with
    shard_optimizer_state and the default all-reduce options."""
    check_gradient_sharding(True, self.shard_optimizer_state,
                            self.all_reduce)

  def _check_parameter_sharding(self):
    """`shard_parameters` (ZeRO-3) extends ZeRO-1 and 2 over (multi-worker)
    mirrored replicas of an unsplit model, whose step reads no whole
    weight, or over the copies of a split on a mesh's data axis (a
    pipeline, or the GPT's tensor split)."""
    for name in ("shard_optimizer_state", "shard_gradients"):
      if not getattr(self, name):
        raise ConfigError(
            f"shard_parameters=True needs {name}=True (ZeRO-3 shards the "
            f"weights of ZeRO-1 and 2's sharded update); add --{name}")
    split = self.model_parallel
    where = (f"mesh={split.mesh}" if split.mesh
             else f"model_parallel={split.mode}")
    if split.mode != "none":
      recompute = parse_recompute(split.recompute)
      if recompute not in (False, True):
        raise ConfigError(
            f"shard_parameters=True with {where} runs each layer's block "
            f"again in the backward pass (it joins the block's weights "
            f"again there); recompute={split.recompute} is not supported "
            f"with it: use --recompute=none or true")
    elif self.strategy not in ("mirrored", "multi_worker_mirrored"):
      raise ConfigError(
          f"shard_parameters=True shards the weights over the replicas of "
          f"mirrored or multi_worker_mirrored, not strategy={self.strategy}")
    for name, value, what in (
        ("ema_decay", self.ema_decay, "an EMA of the whole weights"),
        ("log_layer_norms", self.log_layer_norms,
         "per-layer norms of the whole weights"),
        ("jit_compile", self.jit_compile,
         "XLA around the gathering collectives"),
        ("check_distribution", self.check_distribution,
         "a probe optimizer over the whole weights")):
      if value not in (None, False):
        raise ConfigError(
            f"shard_parameters=True does not support {name}={value} ({what} "
            f"inside the step); turn {name} off")
    if split.mode == "none":
      layers_per_unit(self.model_parallel.recompute)

  def _check_checkpoint_sharding(self):
    """`checkpoint_sharding=by_task` needs a model whose variables one
    program keeps on several tasks: a split over a cluster's workers."""
    loop = self.loop or LoopConfig(train_steps=1)
    if loop.checkpoint_sharding != "by_task":
      return
    if self.strategy == "parameter_server":
      why = ("strategy=parameter_server keeps the variables on the ps "
             "tasks, and each writes its own already")
    elif (self.model_parallel.devices != "cluster" or
          self.model_parallel.mode == "none"):
      why = (f"strategy={self.strategy} without a model split over the "
             "cluster's workers has each process hold (and write) a whole "
             "copy")
    else:
      return
    raise ConfigError(
        f"checkpoint_sharding=by_task writes each task's pieces of a model "
        f"split across processes (--model_parallel_devices=cluster with "
        f"--mesh, --model_parallel or --num_stages); {why}: use "
        f"checkpoint_sharding=gathered")

  def _check_eval_splits(self):
    """`best_metric` and `stop_when` name eval sets this run has."""
    loop = self.loop or LoopConfig(train_steps=1)
    splits = {"eval"} | {f"eval_{spec.name}" for spec in
                         parse_all(self.eval_sets)}
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


DEFAULT_EVAL_NAME = "standalone"
# What only `evaluate.py --watch` reads (`setting(read_by=...)`).
_WATCH = {"watch": ("true",)}


def _local_path(path):
  return os.path.realpath(path) if "://" not in path else path.rstrip("/")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """What to evaluate, where, and how long to wait for new checkpoints.

  Attributes:
    model_dir: the training run's directory.
    checkpoint: a checkpoint path (`.../ckpt-200`); default: the latest.
    strategy, tpu: as for training (any strategy but parameter_server).
    dataset, data_dir, global_batch_size: default to the run's.
    eval_dir: TensorBoard directory; default model_dir/eval_<eval_name>.
      Never the run's own model_dir/eval (its training curves).
    eval_name: names the default eval_dir (letters, digits, `_.-`).
    poll_seconds: how often `watch` looks for a new checkpoint.
    timeout_seconds: `watch` stops after this long with nothing new.
    model: the model (registered name or `module:function`) instead of
      model_info.json's; naming it trusts your own copy of its code,
      imported from your `sys.path` or current folder, never the run's.
    trust_model_code: import the `module:function` model_info.json names,
      from the run's recorded folder if need be (off by default: see
      `export.build_inference_model`).
  """
  model_dir: str = setting(help="The training run's directory.")
  checkpoint: str | None = setting(
      None, "A checkpoint path (.../ckpt-N); default: the latest in "
      "--model_dir.")
  strategy: str = setting(default(ExperimentConfig, "strategy"),
                          "tf.distribute strategy for evaluation.",
                          choices=EVAL_STRATEGIES)
  tpu: str | None = setting(None, "TPU for --strategy=tpu.",
                            read_by={"strategy": ("tpu",)})
  dataset: str | None = setting(None, "Default: the run's dataset.")
  data_dir: str | None = setting(None, "Default: the run's data_dir.")
  global_batch_size: int | None = setting(None, "Default: the run's.",
                                          minimum=POSITIVE)
  eval_dir: str | None = setting(
      None, "TensorBoard directory (default: <model_dir>/eval_<eval_name>); "
      "never the run's own <model_dir>/eval.")
  eval_name: str = setting(DEFAULT_EVAL_NAME, "Names the default "
                           "--eval_dir: <model_dir>/eval_<eval_name>.")
  poll_seconds: float = setting(
      5.0, "--watch: seconds between looks for a new checkpoint.",
      read_by=_WATCH)
  timeout_seconds: float = setting(
      3600.0, "--watch: stop after this long without a new checkpoint "
      "(exit 1 if none came at all).", read_by=_WATCH)
  model: str | None = setting(
      None, "The model (registered name or package.module:function) instead "
      "of model_info.json's; naming a module trusts your own copy of it, "
      "imported from PYTHONPATH or the current folder, never the run's.")
  trust_model_code: bool = setting(
      False, "Import the module:function that model_info.json names, from "
      "the run's recorded folder if it is not on PYTHONPATH (runs that "
      "module's code; off by default, as Keras's safe_mode).")

  def __post_init__(self):
    if not self.model_dir:
      raise ConfigError("model_dir must be set")
    check_settings(self)
    for name in ("poll_seconds", "timeout_seconds"):
      if not getattr(self, name) > 0:
        raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.eval_name or "") or (
        self.eval_name in (".", "..")):
      raise ConfigError(f"eval_name={self.eval_name!r} must be a folder name "
                        "(letters, digits, _ . -), e.g. "
                        f"{DEFAULT_EVAL_NAME}")
    own = os.path.join(self.model_dir, "eval")
    if _local_path(self.summary_dir) == _local_path(own):
      raise ConfigError(
          f"eval_dir={self.eval_dir!r} is the training run's own evaluation "
          f"curves ({own}); an evaluator writes elsewhere (default: "
          f"{os.path.join(self.model_dir, 'eval_' + DEFAULT_EVAL_NAME)})")

  @property
  def summary_dir(self):
    """Where the evaluator's TensorBoard summaries go."""
    return self.eval_dir or os.path.join(self.model_dir,
                                         "eval_" + self.eval_name)


@dataclasses.dataclass(frozen=True)
class PredictConfig:
  """One prediction on the CPU from a training run's weights.

  Attributes:
    model_dir: the training run's directory (model_info.json, weights).
    weights: a .weights.h5 file, or `best` (default: the run's own).
    model, trust_model_code: as for `EvalConfig`.
    index, image: classify an example of the run's test split, or a file.
    data_dir: the dataset's directory for `index` (default: the run's).
    output_json, save_image: where the result and the image also go.
    prompt, max_new_tokens, temperature, seed: a language model's run
      continues `prompt` (`prediction.generate_text`).
  """
  model_dir: str | None = setting(
      None, "A training run's directory (model_info.json, model.weights.h5).")
  weights: str | None = setting(
      None, "A .weights.h5 file (default: <model_dir>/model.weights.h5), or "
      "best: the best checkpoint's weights (<model_dir>/best/, kept by "
      "train.py --best_metric).")
  model: str | None = setting(
      None, "Model name or package.module:function; overrides "
      "model_info.json (naming a module trusts your own copy of it, from "
      "PYTHONPATH or the current folder, never the run's), or names a "
      "CIFAR-10 model when there is none.")
  trust_model_code: bool = same_as(EvalConfig, "trust_model_code")
  index: int | None = setting(
      None, "Index into the run's own test split (its dataset from "
      "model_info.json: cifar10, synthetic, tfrecord, image_folder, "
      "tfds:NAME); prints the true label too.")
  image: str | None = setting(None, "A PNG or JPEG file, resized to the "
                              "model's input.")
  data_dir: str | None = setting(
      None, "The dataset's directory for --index (default: the run's; "
      "CIFAR-10 without one: Keras's cache).")
  output_json: str | None = setting(None, "Also write the result here.")
  prompt: str | None = setting(
      None, "A language model's run: the text to continue (UTF-8 bytes are "
      "its tokens).")
  max_new_tokens: int = setting(200, "--prompt: tokens (bytes) to generate.")
  temperature: float = setting(
      0.0, "--prompt: 0 = greedy (always the most likely token); > 0 "
      "samples from softmax(logits / temperature).")
  seed: int = setting(default(InputConfig, "seed"), "--prompt with "
                      "--temperature > 0: the sampling seed (the same seed, "
                      "the same text).")
  save_image: str | None = setting(None, "Write the classified image (as "
                                   "fed to the model) to this PNG.")

  def __post_init__(self):
    check_settings(self)
    if not self.temperature >= 0:
      raise ConfigError(f"temperature={self.temperature!r} must be >= 0 (0: "
                        "greedy)")
