"""The core layer's settings: the loop's and the optimizer's configs.

TensorFlow-free (`framework.settings`): `scripts/config_flags.py` makes the
flags from these fields before TensorFlow loads. The modules that act on
them (`controller`, `optimizers`, `trainer`, ...) import them from here.
"""

import dataclasses
import math
import operator
import re
from typing import Mapping, Optional

from framework.errors import ConfigError
from framework.settings import (NON_NEGATIVE, POSITIVE, check_settings,
                                flag_name, setting)


OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "step", "linear", "onecycle", "wsd")
# Schedules whose length is the run's (total_steps filled in when 0).
DECAYING_SCHEDULES = ("cosine", "linear", "onecycle", "wsd")
# The tail of lr_schedule=wsd.
DECAY_SHAPES = ("linear", "cosine")
LR_SCALINGS = ("none", "linear", "sqrt")
# What `nan_policy` may be: see `Trainer`.
NAN_POLICIES = ("stop", "skip")
# What `spike_policy` may be: see `Trainer` and `framework.core.spikes`.
SPIKE_POLICIES = ("none", "skip", "rollback")
# The fewest losses whose median a spike is judged against.
MIN_SPIKE_WINDOW = 3
# The window is a variable in every step and checkpoint; a median over more
# steps than this is no longer a running one.
MAX_SPIKE_WINDOW = 100_000
# A damaged newest checkpoint: see `CheckpointManager`.
RESTORE_POLICIES = ("latest_intact", "error")
# Who writes a checkpoint's tensors (`framework.core.checkpoints.sharding`).
CHECKPOINT_SHARDINGS = ("gathered", "by_task")
# Compute dtypes; `auto` resolves to one of PRECISIONS on this machine
# (`precision.resolve_precision`).
PRECISIONS = ("float32", "bfloat16", "float16")
PRECISION_CHOICES = PRECISIONS + ("auto",)
# Test-time augmentation in evaluation (`framework.core.evaluation`).
TTA_MODES = ("none", "flip")
# The gradient all-reduce (`framework.core.gradients`).
ALL_REDUCE_IMPLEMENTATIONS = ("auto", "ring", "nccl")
ALL_REDUCE_DTYPES = ("float32", "bfloat16")
# Which way `best_metric` improves (`framework.core.checkpoints.best`).
BEST_MODES = ("auto", "max", "min")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """How long to train and how often to do what (0 disables an interval).

  Attributes:
    train_steps: total global steps.
    steps_per_loop: most steps run inside one `tf.function` call; or a
      function of the global step returning that number (Orbit's), e.g.
      `lambda step: 10 if step < 100 else 1000`.
    checkpoint_every, eval_every, summary_every, log_every: intervals in
      steps; a checkpoint and an evaluation also happen at the end.
    keep_checkpoints: how many checkpoints to keep.
    async_checkpoint: write checkpoints in the background (one process
      only); a checkpoint is listed once complete, the final one is waited
      for, a failed write is an error at the next save or at the end.
    checkpoint_sharding: `gathered` (a split weight is joined on the chief
      and written there) or `by_task` (each task of a model split across
      processes writes its own pieces; `framework.core.checkpoints.sharding`).
    profile_steps: `(first, last)` global steps (inclusive) to trace with
      TensorFlow's profiler into `model_dir/train` (TensorBoard's Profile
      tab); the time per op type goes to the log and a text summary.
    stop_at_accuracy: stop training after the first evaluation (every
      `eval_every` steps, and at the end) whose `accuracy` (or
      `pixel_accuracy`) reaches this value in (0, 1]; a checkpoint is saved
      and the run ends as at its last step. The time it took goes to the
      log and to TensorBoard as `eval/time_to_target_seconds` (see
      `Controller.time_to_target`). None: train to `train_steps`. The same
      as `stop_when="eval/accuracy>=VALUE"`.
    stop_when: early stopping on any metric and direction,
      `SPLIT/METRIC OP VALUE` (`framework.core.config`): e.g.
      `eval/loss<0.1` (checked after each evaluation) or `train/loss<=0.05`
      (after each loop, on the loop's mean). The run ends as with
      `stop_at_accuracy`; `time_to_target_seconds` goes under the
      condition's split. None: off.
    eval_start_step: periodic evaluations (`eval_every`) only from this
      step on: a time-to-accuracy run skips evaluations that cannot reach
      its target yet. The final evaluation always happens.
    best_metric: `SPLIT/METRIC` of an eval set (`eval/accuracy`,
      `eval_test/loss`): after each evaluation that improves it the chief
      writes `model_dir/best/` (`framework.core.checkpoints.best`). None: off.
    best_mode: `max`, `min` or `auto` (max for accuracy-like names: acc,
      auc, iou, precision, recall, f1; else min).
    best_min_delta: an improvement must exceed this (>= 0).
    early_stopping_patience: stop after this many evaluations in a row
      without an improvement of `best_metric` (Keras `EarlyStopping`); the
      run is then finished (a relaunch trains nothing). None: off.
    early_stopping_start_step: evaluations before this step do not count
      towards the patience.
    restore_best_on_stop: a run stopped early ends with the best weights
      (its final evaluation, weights file and export are the best ones).
    eval_steps: evaluate the first N global batches of each eval set only
      (Keras `validation_steps`; `framework.core.evaluation`). None: all.
    straggler_factor: on a multi-worker cluster the chief names, at each
      log step, the workers whose compute per step exceeds the other
      workers' median this many times (> 1); every worker's compute and wait per step go
      to `train/step_time/<task>_<index>/{compute,wait}`.
  """
  # Filled in from the run's --train_steps or --epochs.
  train_steps: int = setting(flag=False, minimum=POSITIVE)
  steps_per_loop: int = setting(100, "Steps inside one tf.function.",
                                minimum=POSITIVE)
  checkpoint_every: int = setting(
      1000, "Steps between checkpoints (0: only at the end).",
      minimum=NON_NEGATIVE)
  keep_checkpoints: int = setting(3, "Checkpoints to keep.", minimum=POSITIVE)
  async_checkpoint: bool = setting(
      False, "Write checkpoints in the background: the loop waits only for "
      "the variables' copy, not the disk (one process only).")
  checkpoint_sharding: str = setting(
      "gathered", "Who writes a checkpoint of a model split across "
      "processes (--model_parallel_devices=cluster): gathered = the chief "
      "joins each split weight and writes it; by_task = each task writes "
      "the pieces it holds, nothing is joined (the same checkpoint keys: "
      "any layout restores either).", choices=CHECKPOINT_SHARDINGS)
  eval_every: int = setting(
      0, "Steps between evaluations (0: only at the end).",
      minimum=NON_NEGATIVE)
  summary_every: int = setting(100, "Steps between train summaries.",
                               minimum=NON_NEGATIVE)
  log_every: int = setting(100, "Steps between progress lines.",
                           minimum=NON_NEGATIVE)
  profile_steps: tuple[int, ...] = setting(
      (), "first,last: trace these global steps (inclusive) with "
      "TensorFlow's profiler into model_dir/train (TensorBoard's Profile "
      "tab) and log the time per op type, e.g. 10,14.")
  stop_at_accuracy: float | None = setting(
      None, "Stop after the first evaluation whose accuracy reaches this "
      "fraction (e.g. 0.8079); logs and writes eval/time_to_target_seconds "
      "(wall time from the run's start: data loading, steps and evaluations "
      "included).")
  eval_start_step: int = setting(
      0, "Periodic evaluations (--eval_every) only from this step on.",
      minimum=NON_NEGATIVE)
  stop_when: str | None = setting(
      None, "Early stopping on any metric: SPLIT/METRIC OP VALUE with SPLIT "
      "train (each loop's mean) or eval (each evaluation) and OP one of < "
      "<= > >=, e.g. eval/loss<0.1; the run ends as at its last step and "
      "writes SPLIT/time_to_target_seconds. --stop_at_accuracy=X is "
      "eval/accuracy>=X.")
  best_metric: str | None = setting(
      None, "Keep the best checkpoint by this eval scalar, SPLIT/METRIC "
      "(eval/accuracy, eval/loss, eval_<set>/<metric>): after each "
      "evaluation that improves it, model_dir/best/ holds its checkpoint, "
      "the weights evaluation used and best.json; never rotated away.")
  best_mode: str = setting(
      "auto", "Whether --best_metric improves up (max) or down (min); auto: "
      "max for accuracy-like names (acc, auc, iou, precision, recall, f1), "
      "else min.", choices=BEST_MODES)
  best_min_delta: float = setting(
      0.0, "An improvement of --best_metric must exceed this (>= 0).")
  early_stopping_patience: int | None = setting(
      None, "Stop after this many evaluations in a row without an "
      "improvement of --best_metric by more than --best_min_delta; the run "
      "is then finished (a relaunch trains nothing). 0 unsets it.",
      zero_unsets=True, minimum=POSITIVE)
  early_stopping_start_step: int = setting(
      0, "Evaluations before this step do not count towards "
      "--early_stopping_patience.", minimum=NON_NEGATIVE)
  eval_steps: int | None = setting(
      None, "Evaluate the first N global batches of each eval set only "
      "(Keras validation_steps); the log and the summary eval_steps say so. "
      "0 unsets it.", zero_unsets=True, minimum=POSITIVE)
  restore_best_on_stop: bool = setting(
      False, "A run stopped by --early_stopping_patience ends with the best "
      "weights: its final evaluation, weights file and export are the best "
      "checkpoint's.")
  straggler_factor: float = setting(
      1.5, "Multi-worker runs: at each log step the chief logs one line "
      "naming every worker whose compute per step (its step time less its "
      "wait in the gradient all-reduce) exceeds the other workers' median "
      "this many times; each worker's compute and wait go to TensorBoard and "
      "metrics.jsonl as train/step_time/<task>_<index>/compute and wait "
      "(seconds per step). Must be > 1.",
      read_by={"strategy": ("multi_worker_mirrored",)})

  def __post_init__(self):
    from framework.perf import profiling  # pylint: disable=g-import-not-at-top
    if callable(self.steps_per_loop):
      # Orbit's form, a function of the global step: the Controller checks
      # what it returns; every other field is checked here.
      checked = dataclasses.replace(self, steps_per_loop=1)
      object.__setattr__(self, "profile_steps", checked.profile_steps)
      return
    if self.stop_at_accuracy is not None and not (
        0 < self.stop_at_accuracy <= 1):
      raise ConfigError(f"stop_at_accuracy={self.stop_at_accuracy} must be "
                        "in (0, 1] (a fraction, e.g. 0.8079)")
    if self.stop_when is not None:
      if self.stop_at_accuracy is not None:
        raise ConfigError(
            f"stop_at_accuracy={self.stop_at_accuracy} and stop_when="
            f"{self.stop_when!r}: set one (stop_at_accuracy=X is "
            "stop_when=eval/accuracy>=X)")
      StopCondition.parse(self.stop_when)
    object.__setattr__(self, "profile_steps",
                       profiling.check_profile_steps(self.profile_steps))
    check_settings(self)
    if (isinstance(self.straggler_factor, bool)
        or not isinstance(self.straggler_factor, (int, float))
        or not 1 < self.straggler_factor < float("inf")):
      raise ConfigError(
          f"straggler_factor={self.straggler_factor!r} must be a number > 1 "
          "(a worker slower than the other workers' median by this factor "
          "is named; e.g. "
          "1.5)")
    self._check_best()

  def _check_best(self):
    if self.best_metric is not None:
      parse_metric(self.best_metric)
    if not (isinstance(self.best_min_delta, (int, float))
            and 0 <= self.best_min_delta < float("inf")):
      raise ConfigError(f"best_min_delta={self.best_min_delta!r} must be a "
                        "finite number >= 0")
    needs = {"early_stopping_patience": self.early_stopping_patience,
             "early_stopping_start_step": self.early_stopping_start_step,
             "restore_best_on_stop": self.restore_best_on_stop}
    if self.best_metric is None:
      for name, value in needs.items():
        if value:
          raise ConfigError(f"{name}={value} needs best_metric (the eval "
                            "scalar it watches, e.g. eval/accuracy)")
    if self.restore_best_on_stop and self.early_stopping_patience is None:
      raise ConfigError("restore_best_on_stop=True needs "
                        "early_stopping_patience (what stops the run)")

  def stop_condition(self) -> "StopCondition | None":
    """`stop_when` (or `stop_at_accuracy`) parsed; None when neither."""
    if self.stop_when is not None:
      return StopCondition.parse(self.stop_when)
    if self.stop_at_accuracy is not None:
      return StopCondition("eval", "accuracy", ">=", self.stop_at_accuracy)
    return None


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """What `optimizers.make_optimizer` builds.

  Attributes:
    name: one of OPTIMIZERS; `momentum` is SGD with `momentum`.
    learning_rate: the peak learning rate.
    schedule: `constant`, `cosine` (to `min_lr_ratio` × peak at `total_steps`),
      `step` (× `step_decay` at each of `step_boundaries`), `linear` (after
      the warm-up, a straight line from the peak to `min_lr_ratio` × peak at
      `total_steps`) or `onecycle` (a triangle: `linear` whose warm-up, when
      `warmup_steps` is 0, is the first ONECYCLE_RISE (30 %) of the run) or
      `wsd` (warmup-stable-decay: the warm-up, the peak, then over the last
      `decay_fraction` of `total_steps` down to `min_lr_ratio` × peak,
      `decay_shape` linear or cosine).
    decay_fraction: for `wsd`, the fraction of `total_steps`, in (0, 1],
      that is the decay tail.
    decay_shape: for `wsd`, `linear` or `cosine`.
    warmup_steps: linear warm-up length (from ~0 to the peak), 0 for none.
    total_steps: length of the cosine / linear / onecycle schedule.
    weight_decay: decoupled weight decay for `adamw`.
    nesterov: Nesterov momentum for `momentum` (one fused kernel too).
    lr_scaling: `none`, `linear` or `sqrt`: the peak `learning_rate` is for
      a global batch of `base_batch_size`; `scaled(global_batch_size)` scales
      it by (global / base) or its square root (Goyal et al., 2017).
    base_batch_size: the batch `learning_rate` was tuned for.
  """
  name: str = setting("adam", "Optimizer.", flag="optimizer",
                      choices=OPTIMIZERS, key=True)
  learning_rate: float = setting(1e-3, "Peak learning rate.", key=True)
  momentum: float = setting(0.9, "Momentum for --optimizer=momentum.",
                            read_by={"optimizer": ("momentum",)})
  weight_decay: float = setting(1e-4, "Decoupled weight decay (adamw).",
                                read_by={"optimizer": ("adamw",)})
  schedule: str = setting(
      "constant", "Learning-rate schedule after warm-up. linear: straight "
      "down to --lr_min_ratio x peak at the last step; onecycle: linear "
      "whose warm-up defaults to the first 30 % of the run; wsd: warm-up, "
      "the peak, then the last --decay_fraction of the run down to "
      "--lr_min_ratio x peak (--decay_shape).",
      flag="lr_schedule", choices=SCHEDULES, key=True)
  warmup_steps: int = setting(0, "Linear warm-up steps.")
  decay_fraction: float = setting(
      0.2, "lr_schedule=wsd: the fraction of the run, in (0, 1], that is the "
      "decay tail (after the warm-up and the stable peak).",
      read_by={"lr_schedule": ("wsd",)})
  decay_shape: str = setting(
      "linear", "lr_schedule=wsd: the decay tail's shape, from the peak to "
      "--lr_min_ratio x peak at the last step.", choices=DECAY_SHAPES,
      read_by={"lr_schedule": ("wsd",)})
  # 0: filled in from the run's length (cosine, linear, onecycle).
  total_steps: int = setting(0, flag=False)
  step_boundaries: tuple[int, ...] = setting(
      (), "Steps where --lr_schedule=step multiplies the rate by "
      "--lr_step_decay.", flag="lr_step_boundaries",
      read_by={"lr_schedule": ("step",)})
  step_decay: float = setting(0.1, "Factor at each step boundary.",
                              flag="lr_step_decay",
                              read_by={"lr_schedule": ("step",)})
  min_lr_ratio: float = setting(
      0.0, "cosine, linear, onecycle: final learning rate as a fraction of "
      "the peak.", flag="lr_min_ratio",
      read_by={"lr_schedule": DECAYING_SCHEDULES})
  nesterov: bool = setting(False, "Nesterov momentum for "
                           "--optimizer=momentum.")
  lr_scaling: str = setting(
      "none", "Scale --learning_rate from --lr_base_batch_size to "
      "--global_batch_size (linear: by the ratio; sqrt: by its square root).",
      choices=LR_SCALINGS)
  base_batch_size: int = setting(
      256, "The global batch --learning_rate is given for (with "
      "--lr_scaling).", flag="lr_base_batch_size", minimum=POSITIVE,
      read_by={"lr_scaling": ("linear", "sqrt")})

  def __post_init__(self):
    check_settings(self)
    if self.nesterov and self.name != "momentum":
      raise ConfigError(f"nesterov=True needs optimizer=momentum (got "
                        f"optimizer={self.name})")
    if not 0 <= self.min_lr_ratio <= 1:  # named as its flag
      raise ConfigError(f"lr_min_ratio={self.min_lr_ratio} must be in [0, 1]")
    if not 0 <= self.weight_decay < math.inf:
      raise ConfigError(f"weight_decay={self.weight_decay} must be a number "
                        ">= 0 (0: no decay)")
    if not self.learning_rate > 0:
      raise ConfigError(f"learning_rate={self.learning_rate} must be > 0")
    if self.learning_rate == math.inf:  # one step would make every weight inf
      raise ConfigError(f"learning_rate={self.learning_rate} must be finite "
                        "(a number > 0, e.g. 0.001)")
    if self.warmup_steps < 0:
      raise ConfigError(f"warmup_steps={self.warmup_steps} must be >= 0")
    if not 0 < self.decay_fraction <= 1:
      raise ConfigError(f"decay_fraction={self.decay_fraction} must be in "
                        "(0, 1] (the fraction of the run that decays, e.g. "
                        "0.2)")
    if self.total_steps < 0:  # 0: filled in from the run's length (cosine)
      raise ConfigError(f"total_steps={self.total_steps} must be >= 0")
    if self.schedule == "step" and not self.step_boundaries:
      raise ConfigError("lr_schedule=step needs lr_step_boundaries, e.g. "
                        "'5000,8000'")
    if list(self.step_boundaries) != sorted(set(self.step_boundaries)):
      raise ConfigError(f"lr_step_boundaries={list(self.step_boundaries)} "
                        "must be strictly increasing")

  def scaled(self, global_batch_size):
    """This config with `learning_rate` scaled for `global_batch_size`."""
    ratio = global_batch_size / self.base_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": ratio**0.5}[
        self.lr_scaling]
    return dataclasses.replace(self, learning_rate=self.learning_rate * factor,
                               lr_scaling="none")


@dataclasses.dataclass(frozen=True)
class AllReduceConfig:
  """The gradient all-reduce's packing, implementation and wire dtype (see
  `framework.core.gradients`).

  Attributes:
    bytes_per_pack: pack size in bytes, >= 0 (0: one pack).
    implementation: one of ALL_REDUCE_IMPLEMENTATIONS.
    dtype: one of ALL_REDUCE_DTYPES: the dtype float32 gradients have on
      the wire.
    overlap: one all-reduce per bucket of gradients, in backward order, so
      that each bucket goes out while the backward pass is still computing
      the earlier layers' gradients (buckets of `bytes_per_pack` bytes, or
      OVERLAP_BUCKET_BYTES where that is 0).
  """
  bytes_per_pack: int = setting(
      0, "Pack the gradients into all-reduces of about this many bytes each "
      "(0: one all-reduce for all); collective strategies "
      "(multi_worker_mirrored) only.", flag="all_reduce_bytes_per_pack",
      minimum=NON_NEGATIVE)
  implementation: str = setting(
      "auto", "Collective all-reduce implementation (nccl: GPUs only).",
      flag="all_reduce_implementation", choices=ALL_REDUCE_IMPLEMENTATIONS)
  dtype: str = setting(
      "float32", "dtype of the gradients on the wire: bfloat16 halves the "
      "bytes; the update is applied in float32.", flag="all_reduce_dtype",
      choices=ALL_REDUCE_DTYPES)
  overlap: bool = setting(
      False, "One all-reduce per bucket of gradients (--all_reduce_bytes_per_"
      "pack bytes, 1 MiB if 0), last layer first, each issued as soon as its "
      "gradients exist, so communication overlaps the rest of the backward "
      "pass; any strategy.", flag="all_reduce_overlap")

  def __post_init__(self):
    check_settings(self)

  @property
  def is_default(self):
    return self == AllReduceConfig()


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """The step settings `Trainer` takes as keyword arguments (see `Trainer`):
  declared here once, read by `ExperimentConfig` (the same fields) and by
  `Trainer.__init__` (its keyword defaults).

  Attributes:
    clip_norm: clip the all-reduced gradient to this global norm.
    nan_policy: one of NAN_POLICIES.
    max_skipped_steps: under `nan_policy=skip`, stop after this many
      skipped steps in a row.
    spike_policy: one of SPIKE_POLICIES (`framework.core.spikes`).
    spike_factor: a step is a spike when its loss or gradient norm is above
      the median of the last `spike_window` steps' times this (finite, > 1).
    spike_window: the steps that median is taken over (3 to 100000).
    grad_accum_steps: micro-batches per replica batch.
    ema_decay: an EMA of the trainable weights with this decay (None: off).
    ema_warmup: the EMA's decay ramps up as min(decay, (1+n)/(10+n)).
    eval_tta: one of TTA_MODES.
    all_reduce: the gradient all-reduce's `AllReduceConfig`.
    jit_compile: compile the replica step with XLA where it can.
    shard_optimizer_state: ZeRO-1 over the replicas.
    shard_gradients: ZeRO-2 over the replicas or a split's copies (with
      shard_optimizer_state).
    weight_decay_exclude: a regular expression: the optimizer's weight
      decay leaves out the variables whose path it matches; None: the
      default groups (`framework.core.weight_decay`).
    log_layer_norms: per-layer gradient norm, weight norm and update/weight
      ratio as summaries (`framework.core.layer_norms`).
  """
  clip_norm: float | None = setting(None, "Clip the all-reduced gradient to "
                                    "this global norm.")
  nan_policy: str = setting(
      "stop", "On a NaN/Inf loss: stop (keep the last good checkpoint) or "
      "skip the step.", choices=NAN_POLICIES)
  max_skipped_steps: int = setting(
      10, "--nan_policy=skip: stop with an error (saving nothing) after this "
      "many skipped steps in a row.", minimum=POSITIVE,
      read_by={"nan_policy": ("skip",)})
  spike_policy: str = setting(
      "none", "On a loss spike (--spike_factor): none (train on), skip (drop "
      "that step's update, counted and logged) or rollback (restore the last "
      "checkpoint and skip the batches since it, up to the spike; recorded "
      "in model_dir/spike_batches.json so a relaunch skips them too).",
      choices=SPIKE_POLICIES)
  spike_factor: float = setting(
      4.0, "--spike_policy: a step whose global loss, or gradient norm "
      "before clipping, is above the median of the last --spike_window "
      "steps' times this is a spike (a finite number > 1).",
      read_by={"spike_policy": ("skip", "rollback")})
  spike_window: int = setting(
      50, "--spike_policy: the steps the running median is taken over; no "
      "spike is decided before that many steps ran (3 to 100000).",
      minimum=POSITIVE, read_by={"spike_policy": ("skip", "rollback")})
  grad_accum_steps: int = setting(
      1, "Split each replica's batch into this many micro-batches; one "
      "all-reduce and update per step (same update, less activation "
      "memory).", minimum=POSITIVE)
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
  jit_compile: bool = setting(
      False, "Compile the replica step with XLA: the whole step on one "
      "replica, each replica's forward and backward pass under several "
      "(the all-reduce and update outside); a warning and no XLA under "
      "parameter_server or model parallelism.")
  shard_optimizer_state: bool = setting(
      False, "Each replica keeps and updates 1/N of the optimizer's slots "
      "and the weights are all-gathered after the update (ZeRO-1; mirrored "
      "and multi_worker_mirrored, sgd/momentum/adam/adamw); checkpoints hold "
      "the whole slots, so a run resumes with it on or off and on another "
      "replica count.")
  shard_gradients: bool = setting(
      False, "With --shard_optimizer_state: each replica (or each copy of a "
      "split on a mesh's data axis) also keeps only its 1/N of the reduced "
      "gradient (ZeRO-2): the gradients are reduce-scattered, under "
      "--grad_accum_steps each micro-batch's, so that only the 1/N is "
      "accumulated. Needs the default --all_reduce_* options; checkpoints "
      "are unchanged (a run resumes with it on or off).")
  weight_decay_exclude: str | None = setting(
      None, "Weight decay (adamw) leaves out the variables whose path "
      "(block_0/mlp/fc/bias) matches this regular expression. Unset: it "
      "decays matmul and convolution kernels only, leaving out every "
      "variable of fewer than 2 dimensions (biases, norm scales and "
      "offsets) and the embedding tables (variables named embeddings or "
      "positions), as language-model recipes do; '^$' decays every "
      "variable, as before. This changes --optimizer=adamw runs of every "
      "model with biases, norms or embeddings (gpt, mlp, cifar_cnn, unet); "
      "sgd, momentum and adam have no weight decay, so the seed recipe "
      "(momentum) is unchanged.", read_by={"optimizer": ("adamw",)})
  log_layer_norms: bool = setting(
      False, "Write each layer's gradient norm (the applied gradient: "
      "all-reduced, after clipping), weight norm and update/weight ratio "
      "||w_after - w_before|| / ||w_before|| to TensorBoard at "
      "--summary_every steps (scalars layer_norms/<layer>/..., histograms "
      "layer_norms_hist/...); off: not one op more in the step. The default "
      "train step only (not model parallelism; the parameter-server "
      "coordinator records no summaries from inside steps).",
      read_by={"model_parallel": ("none",)})

  def __post_init__(self):
    check_settings(self)
    if self.weight_decay_exclude is not None:
      try:
        re.compile(self.weight_decay_exclude)
      except (re.error, TypeError) as e:
        raise ConfigError(
            f"weight_decay_exclude={self.weight_decay_exclude!r} is not a "
            f"regular expression ({e}); e.g. 'bias|norm', or '^$' to decay "
            "every variable") from None
    if self.clip_norm is not None and not self.clip_norm > 0:
      raise ConfigError(f"clip_norm={self.clip_norm} must be > 0 (or unset)")
    if self.ema_decay is not None and not 0 < self.ema_decay < 1:
      raise ConfigError(f"ema_decay={self.ema_decay} must be in (0, 1) (or "
                        "unset)")
    if not 1 < self.spike_factor < math.inf:
      raise ConfigError(f"spike_factor={self.spike_factor} must be a finite "
                        "number > 1 (a spike is a loss above the running "
                        "median times it)")
    if not MIN_SPIKE_WINDOW <= self.spike_window <= MAX_SPIKE_WINDOW:
      raise ConfigError(
          f"spike_window={self.spike_window} must be from {MIN_SPIKE_WINDOW} "
          f"to {MAX_SPIKE_WINDOW} (the steps whose median a spike is judged "
          "against)")

  @classmethod
  def of(cls, config):
    """The TrainerConfig of `config` (any object with these attributes,
    e.g. an `ExperimentConfig`)."""
    return cls(**{f.name: getattr(config, f.name)
                  for f in dataclasses.fields(cls)})


def check_gradient_sharding(shard_gradients, shard_optimizer_state,
                            all_reduce):
  """ConfigError unless `shard_gradients` (ZeRO-2) can go with the other
  settings: it shards the gradients of ZeRO-1's sharded update, and its
  reduce-scatter sums as the default all-reduce does (`all_reduce`: an
  `AllReduceConfig` or None)."""
  if not shard_gradients:
    return
  if not shard_optimizer_state:
    raise ConfigError(
        "shard_gradients=True needs shard_optimizer_state=True (it shards "
        "the gradients of the sharded optimizer update, ZeRO-2 over ZeRO-1); "
        "add shard_optimizer_state or turn shard_gradients off")
  if all_reduce is not None and not all_reduce.is_default:
    changed = ", ".join(
        f"{flag_name(f) or f.name}={getattr(all_reduce, f.name)}"
        for f in dataclasses.fields(all_reduce)
        if getattr(all_reduce, f.name) != f.default)
    raise ConfigError(
        f"shard_gradients=True reduce-scatters the gradients, which {changed} "
        f"does not apply to; keep the default all_reduce options or turn "
        f"shard_gradients off")


# Early-stopping conditions: `SPLIT/METRIC OP VALUE` (TensorFlow-free, so
# that `LoopConfig` checks `stop_when` before TensorFlow loads).
_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt,
        ">=": operator.ge}
# An eval set's split: eval (the run's own) or eval_<name> (`eval_sets`).
_SPLIT = r"(train|eval(?:_[A-Za-z0-9][A-Za-z0-9_-]*)?)"
_CONDITION = re.compile(
    r"^\s*" + _SPLIT + r"/(\S+?)\s*(<=|>=|<|>)\s*([-+0-9.eEinfINFnaN]+)\s*$")
_METRIC = re.compile(r"^" + _SPLIT.replace("train|", "") + r"/([^\s/]+)$")


def parse_metric(text: str, name: str = "best_metric") -> tuple[str, str]:
  """`eval/accuracy` or `eval_<set>/<metric>` as (split, metric);
  ConfigError naming `name` if it is neither."""
  match = _METRIC.match(text) if isinstance(text, str) else None
  if match is None:
    raise ConfigError(
        f"{name}={text!r} must be SPLIT/METRIC with SPLIT eval (the run's "
        "own eval set) or eval_<name> (an eval set), e.g. eval/accuracy, "
        "eval/loss, eval_test/accuracy")
  return match.group(1), match.group(2)


@dataclasses.dataclass(frozen=True)
class StopCondition:
  """`split/metric OP value`, e.g. `eval/loss<0.1`, `train/mae<=0.05`.

  Attributes:
    split: "train" (checked after every loop), "eval" or "eval_<name>"
      (an eval set: after every evaluation).
    metric: a name the trainer returns (or an evaluator's alias of it,
      `metric_aliases`: e.g. the name a task reports accuracy under).
    op: one of <, <=, >, >=.
    value: the threshold.
  """
  split: str
  metric: str
  op: str
  value: float

  @classmethod
  def parse(cls, text: str, name: str = "stop_when") -> "StopCondition":
    """`text` as a condition; ConfigError naming `name` if it is not one."""
    match = _CONDITION.match(text) if isinstance(text, str) else None
    value = None
    if match:
      try:
        value = float(match.group(4))
      except ValueError:
        pass
    if value is None or not math.isfinite(value):
      raise ConfigError(
          f"{name}={text!r} must be SPLIT/METRIC OP VALUE with SPLIT train, "
          "eval or eval_<set>, OP one of < <= > >= and a finite VALUE (e.g. "
          "eval/loss<0.1, eval/accuracy>=0.9)")
    return cls(match.group(1), match.group(2), match.group(3), value)

  def __str__(self):
    return f"{self.split}/{self.metric}{self.op}{self.value:g}"

  def metric_value(self, outputs: Mapping[str, float],
                   aliases: Optional[Mapping[str, str]] = None) -> float:
    """The watched value in `outputs` (under `metric`, else its name in
    `aliases`); ConfigError if there is none."""
    for name in (self.metric, (aliases or {}).get(self.metric)):
      if name in outputs:
        return float(outputs[name])
    raise ConfigError(
        f"stop_when={self}: the {self.split} outputs have no "
        f"{self.metric!r} (only {', '.join(sorted(outputs))})")

  def met(self, outputs: Mapping[str, float],
          aliases: Optional[Mapping[str, str]] = None) -> bool:
    return _OPS[self.op](self.metric_value(outputs, aliases), self.value)
