"""The distribution check's report: verdict, causes, warnings and table."""

import dataclasses
import keras
import tensorflow as tf
import time
from framework.check import distribution_step as steps
from framework.check.distribution_diagnosis import (WARNING_CAUSES, Finding, compare)
from framework.check.distribution_step import PROBE_MOMENTUM
from framework.core.config import TrainerConfig
from framework.data.config import InputConfig
from framework.distribute import strategies
from framework.errors import DistloopError, ConfigError
from framework.settings import default


PASS, WARN, FAIL = "pass", "warn", "fail"


class DistributionCheckError(DistloopError):
  """The distribution check failed: the step trains differently on N replicas."""


@dataclasses.dataclass
class CheckReport:
  """The outcome: `verdict` is pass, warn or fail; `causes` name failures."""
  verdict: str
  causes: list
  warnings: list
  rows: list
  header: str
  seconds: float

  @property
  def cause_codes(self):
    return [c.code for c in self.causes]

  @property
  def warning_codes(self):
    return [w.code for w in self.warnings]

  def table(self):
    lines = [self.header,
             f"  {'':10}{'group':34}{'max abs diff':>13}{'max rel diff':>13}"
             f"{'rel L2 diff':>13}{'tolerance':>11}"]
    for r in self.rows:
      flag = "" if r.ok else "  <-"
      lines.append(f"  {r.section:10}{r.name[:33]:34}{r.max_abs:13.3g}"
                   f"{r.max_rel:13.3g}{r.rel_l2:13.3g}{r.tolerance:11.2g}"
                   f"{flag}")
    lines.append(f"verdict: {self.verdict.upper()} ({self.seconds:.1f} s)")
    for c in self.causes:
      lines.append(f"  FAIL {c.code}: {c.message}")
    for w in self.warnings:
      lines.append(f"  WARN {w.code}: {w.message}")
    return "\n".join(lines)

  def __str__(self):
    return self.table()


def _random_op_warnings(draws):
  """(replaced, left): warnings about the random ops traced in the step."""
  replaced = left = None
  if draws.replaced_ops:
    replaced = Finding(
        "random_ops",
        f"random ops in the step ({'; '.join(draws.replaced_ops)}) draw "
        "different numbers on each device; the check replaced their draws by "
        f"the distribution's centre ({steps.NORMAL:g} for "
        f"normal, {steps.UNIFORM:g} for uniform [0, 1)) on "
        "both sides, so the rest is compared exactly and the random values "
        "are not")
  if draws.left_ops:
    left = Finding(
        "random_ops_left",
        f"random ops in the step that the check cannot replace "
        f"({'; '.join(draws.left_ops)}) still draw different numbers on each "
        "device: a difference they feed may be theirs, not a bug")
  return replaced, left


def verdict_of(causes, layer_warnings, draws, compute_dtype, replicas,
               notes=()):
  """(verdict, causes, warnings) from the diagnosis and what the check
  switched or replaced to compare the sides."""
  replaced, left = _random_op_warnings(draws)
  warnings = list(layer_warnings) + ([replaced] if replaced else [])
  if compute_dtype in ("bfloat16", "float16"):
    warnings.append(Finding(
        "low_precision",
        f"the model computes in {compute_dtype}, whose rounding can move one step "
        f"by several % between {replicas} replicas and one device (BatchNorm "
        "amplifies it) beyond the tolerance; build both sides in float32 to "
        "check the distribution (--check_distribution does)"))
  warnings.extend(notes)
  if left:
    warnings.append(left)
  # A difference the diagnosis put down to rounding is a warning.
  warnings.extend(c for c in causes if c.code in WARNING_CAUSES)
  causes = [c for c in causes if c.code not in WARNING_CAUSES]
  if draws.left_ops:
    # Unexplained otherwise: the random ops the check could not replace are
    # the one difference it knows of between the two sides.
    causes = [dataclasses.replace(c, code="random_ops_left", message=(
        f"{c.message}; random ops the check cannot replace "
        f"({'; '.join(draws.left_ops)}) draw different numbers on each "
        "device, the likely cause")) if c.code in ("update_mismatch",
                                                   "state_mismatch") else c
              for c in causes]
  verdict = FAIL if causes else WARN if warnings else PASS
  return verdict, causes, warnings


def _check_supported(strategy):
  if isinstance(strategy, (tf.distribute.MultiWorkerMirroredStrategy,
                           tf.distribute.experimental.ParameterServerStrategy)):
    raise ConfigError(
        "the distribution check runs on one machine; strategy "
        f"{type(strategy).__name__} is not supported (check with "
        "strategy=mirrored and the same global_batch_size)")


def _describe(trainer):
  strategy = trainer.strategy
  return (f"{type(trainer).__name__} on {type(strategy).__name__} "
          f"({strategy.num_replicas_in_sync} replicas)")


def check_distribution(trainer, make_reference, batch, *, rtol=1e-3,
                       atol=1e-6, probe_optimizer=True, notes=(),
                       print_fn=print):
  """Runs one train step distributed and on one device; compares them.

  What a trainer needs: `strategy`, `model` (its variables are the state),
  `optimizer` and `train_step`. A `Trainer` runs its loop's own step
  (`run_step`) and puts back its `step_variables()`; another trainer runs
  its `distributed_train_step(dist_batch)` if it has one, else
  `strategy.run(train_step)`.

  Args:
    trainer: the trainer to check (built under its strategy or model split),
      or a factory `() -> trainer`. A trainer passed in is restored exactly
      (weights, optimizer, global step, layers) afterwards.
    make_reference: `() -> trainer` building the same model on one device
      (e.g. under `OneDeviceStrategy`). Its starting state is copied from
      `trainer`, variable by variable, so the two models must have the same
      variables in the same order.
    batch: one GLOBAL batch (a nest of arrays, e.g. `(features, labels)`).
    rtol, atol: a group passes when |diff| <= tol * |reference| (L2 norms),
      tol = max(rtol, 10 × the measured rounding noise) capped at 5%, or when
      max|diff| <= atol.
    probe_optimizer: run both with SGD(1, momentum 0.9) so that updates equal
      minus the applied gradient (exact ratios); False uses the trainers' own
      optimizers, whose state is copied too.
    notes: `Finding`s the caller adds to the warnings (e.g. what it changed
      to make the sides comparable).
    print_fn: where the table goes (None: nowhere).

  Returns:
    A `CheckReport`; `verdict` is pass, warn or fail.
  """
  start = time.perf_counter()
  owned = not hasattr(trainer, "train_step")
  if owned:
    trainer = trainer()
  reference = make_reference()
  strategy = trainer.strategy
  _check_supported(strategy)
  if reference.strategy.num_replicas_in_sync != 1:
    raise ConfigError("make_reference must build a single-replica trainer, "
                      f"got {reference.strategy.num_replicas_in_sync}")

  saved = None if owned else steps.snapshot(steps.state_variables(trainer))
  saved_optimizer = trainer.optimizer
  undo = []
  replicas = strategy.num_replicas_in_sync
  clip_norm = getattr(trainer, "clip_norm", None)
  try:
    undo_t, dropouts, unsynced, noisy = steps.prepare_model(
        trainer.model)
    undo = undo_t + steps.prepare_model(reference.model)[0]
    if probe_optimizer:
      trainer.optimizer = steps.probe_optimizer(trainer)
      reference.optimizer = steps.probe_optimizer(reference)
    steps.copy_state(trainer, reference,
                     lambda t: list(t.model.variables) +
                     ([] if probe_optimizer else list(t.optimizer.variables)))
    reg_grads = steps.regularisation_gradients(reference.model)
    # The reference also runs on the batch in reverse order: the same math
    # with another float summation order, which measures the rounding noise
    # of this model (BatchNorm's backward pass, for one, amplifies it).
    micro_batches = getattr(trainer, "grad_accum_steps",
                            default(TrainerConfig, "grad_accum_steps"))
    one_device = lambda b: steps.as_one_device(b, replicas, micro_batches)
    reversed_batch = tf.nest.map_structure(lambda x: tf.reverse(x, [0]),
                                           one_device(batch))
    # Random ops draw their mean on both sides while the steps are traced.
    with steps.neutralised() as draws:
      ref_out, noise_out = steps.run_steps(
          reference, [one_device(batch), reversed_batch], draws)
      dist_out, = steps.run_steps(trainer, [batch], draws)
      rows, causes = compare(dist_out, ref_out, noise_out, replicas, rtol,
                             atol, reg_grads, clip_norm, probe_optimizer)
      if "update_mismatch" in [c.code for c in causes]:
        # Unexplained: does the difference depend on the data at all?
        other = steps.other_batch(batch)
        other_out = (steps.run_steps(trainer, [other], draws)[0],
                     steps.run_steps(reference, [one_device(other)],
                                     draws)[0])
        rows, causes = compare(dist_out, ref_out, noise_out, replicas, rtol,
                               atol, reg_grads, clip_norm, probe_optimizer,
                               other=other_out)
  finally:
    trainer.optimizer = saved_optimizer
    steps.put_back(undo)
    if saved is not None:
      steps.restore(steps.state_variables(trainer), saved)

  verdict, causes, warnings = verdict_of(
      causes, steps.layer_warnings(
          trainer.model, replicas, dropouts, unsynced, noisy), draws,
      str(getattr(trainer.model, "compute_dtype", "")), replicas, notes)
  header = (f"distribution check: {_describe(trainer)} vs "
            f"{_describe(reference)}, one step, same global batch"
            f"{', probe optimizer SGD' if probe_optimizer else ''}")
  report = CheckReport(verdict, causes, warnings, rows, header,
                       time.perf_counter() - start)
  if print_fn is not None:
    print_fn(report.table())
  return report


def check_trainer_class(trainer_cls, build_model, make_optimizer, strategy,
                        batch, *, reference_strategy=None,
                        seed=default(InputConfig, "seed"), **kwargs):
  """`check_distribution` for `trainer_cls` built under `strategy`.

  Args:
    trainer_cls: `Trainer` or a subclass.
    build_model: `() -> keras.Model` (called inside each strategy's scope).
    make_optimizer: `() -> keras optimizer` (likewise).
    strategy: the strategy to check.
    batch: one global batch.
    reference_strategy: default: one device (the first GPU, else the CPU).
    seed: Keras seed for building the models (the reference copies weights).
    **kwargs: the trainer's keyword arguments (global_batch_size, clip_norm,
      ...) and `check_distribution`'s (rtol, atol, probe_optimizer, print_fn).
  """
  _check_supported(strategy)
  check_args = {k: kwargs.pop(k) for k in
                ("rtol", "atol", "probe_optimizer", "print_fn") if k in kwargs}
  reference_strategy = reference_strategy or strategies.make_strategy(
      "one_device")

  def factory(s):
    def make():
      with s.scope():
        model = build_model()
        optimizer = make_optimizer()
      return trainer_cls(model, optimizer, s, **kwargs)
    return make

  keras.utils.set_random_seed(seed)
  return check_distribution(factory(strategy), factory(reference_strategy),
                            batch, **check_args)
