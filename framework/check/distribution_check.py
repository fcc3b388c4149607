"""Proves that a train step trains the same on N replicas as on one device.

The common bugs of custom loops under `tf.distribute` are silent: training
runs, just wrongly. This check runs ONE call of the trainer's own
`train_step` on the same global batch from the same starting state twice,
under the chosen strategy (or model split) and on a single device, and
compares what changed:

    update     weights after - before, per layer (trainable variables)
    state      non-trainable variables (BatchNorm moving statistics)
    optimizer  slots and the step counter
    replicas   the largest spread between a variable's per-replica copies
    metric     the returned metrics (summed shares), and each replica's share

A correct step gives equal numbers up to float rounding. A wrong one leaves
a pattern, from which the likely cause is named (N replicas; gradients
distributed / single device, see `distribution_diagnosis`):

    data-loss gradient ×N         loss averaged over the per-replica batch
    whole gradient ×N, same loss  gradients all-reduced twice
    whole gradient ×1/N           gradient shares averaged instead of summed
    regularisation gradient ×N    regularisation loss added on every replica
    differ while clipping is on   gradient clipped per replica
    replica copies differ         gradients not all-reduced
    a metric from replica 0 only  the other replicas returned 0
    a metric ×N                   a per-replica value returned as a share
    the same offset on any data   a penalty added unscaled on every replica
    optimizer steps ≠ 1           gradients applied never, or more than once

By default both runs use a probe optimizer, SGD(learning_rate=1,
momentum=0.9): its first update is exactly minus the applied gradient, so the
ratios above are exact whatever optimizer the run uses (Adam's first step,
for one, hides a gradient scale). Given equal gradients every optimizer's
update is the same on N replicas and on one, because `Trainer.apply_gradients`
applies the reduced gradient once. Dropout is switched off and BatchNorm
synchronised for the duration of the check (their randomness and per-replica
statistics are expected differences, reported as warnings), so that the rest
is still compared exactly. Everything is put back afterwards.

Randomness: N replicas cannot draw the numbers one device draws, so a correct
stochastic step would differ by its noise. The check makes both sides
deterministic and compares the rest exactly: Keras noise layers
(GaussianNoise, GaussianDropout, AlphaDropout) are switched off like Dropout,
and any other random op traced in the step (tf.random.*, tf.random.Generator,
keras.random, random Keras layers) draws the centre of its distribution
instead (`distribution_randomness`: 0 for normal, 0.5 for uniform [0, 1)),
the same for every example on both sides. Both are named in warnings: the
random values themselves are not compared, and random ops that could not be
replaced (integer, categorical, shuffle draws, or a tf.function traced before
the check) are named as a possible cause. Seeding both sides alike could not
do this: a replica draws a tensor shaped like its part of the batch from its
own op or counter, never the matching rows of the one-device draw.

A difference the known patterns do not explain is run once more on other
data (the first half of the batch, each example twice): if the update and
loss differ from one device by the same amount there, the difference is
independent of the data and of the batch split, which is what a penalty
added in full on every replica (not via tf.nn.scale_regularization_loss)
leaves: the loss is (N - 1) x the penalty higher.

Float32 rounding differs between N replicas and one device (sums are split
differently), and some models amplify it: BatchNorm's backward pass turns
1e-7 into 1e-2 on a CIFAR CNN. So the reference step also runs on the batch
in reverse order (the same math, another summation order); a group fails when
its relative L2 difference exceeds max(rtol, 10 × the largest noise of any
group), capped at 5%, so a wrong factor of N always fails.

In bfloat16 or float16 that noise is not rounding any more: a 1e-6 change of
the input moves one step's gradients of the CIFAR CNN by 2-7% in bfloat16
(BatchNorm again), as far as the split does, while reordering the batch moves
them by far less. So a model computing in low precision is named in a
warning, and `--check_distribution` builds both sides in float32 (the
distribution logic and a float16 loss scale are the same).
"""

import dataclasses
import time

import keras
import numpy as np
import tensorflow as tf

from framework import _tf_internal
from framework.check import distribution_randomness
from framework.distribute import strategies
from framework.check.distribution_diagnosis import (WARNING_CAUSES, Finding,
                                                    Outcome, compare)
from framework.errors import ConfigError, DistloopError

PASS, WARN, FAIL = "pass", "warn", "fail"
PROBE_MOMENTUM = 0.9


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


# --- Running one step. -------------------------------------------------------


def _layers(model):
  return _tf_internal.flatten_layers(model)


# Keras layers that only add noise in training, and the attribute that turns
# the noise off when 0 (their `call` then draws nothing).
_NOISE_LAYERS = ((keras.layers.GaussianNoise, "stddev"),
                 (keras.layers.GaussianDropout, "rate"),
                 (keras.layers.AlphaDropout, "rate"))


def _prepare_model(model):
  """Dropout and noise off, BatchNorm synchronised.

  Returns:
    (undo, dropouts, unsynchronised BatchNorms, noise layers): layer names.
  """
  undo, dropouts, unsynced, noisy = [], [], [], []
  for layer in _layers(model):
    if isinstance(layer, keras.layers.Dropout) and layer.rate > 0:
      dropouts.append(layer.name)
      undo.append((layer, "rate", layer.rate))
      layer.rate = 0.0
    for cls, attr in _NOISE_LAYERS:
      if isinstance(layer, cls) and getattr(layer, attr) > 0:
        noisy.append(layer.name)
        undo.append((layer, attr, getattr(layer, attr)))
        setattr(layer, attr, 0.0)
    if (isinstance(layer, keras.layers.BatchNormalization) and
        not layer.synchronized):
      unsynced.append(layer.name)
      undo.append((layer, "synchronized", False))
      layer.synchronized = True
  return undo, dropouts, unsynced, noisy


def _random_layers(model):
  """Layers other than dropout and noise that draw random numbers."""
  switched_off = (keras.layers.Dropout,) + tuple(c for c, _ in _NOISE_LAYERS)
  return [l.name for l in _layers(model)
          if getattr(l, "seed_generator", None) is not None
          and not isinstance(l, switched_off)]


def _local_values(strategy, variable):
  """Every per-device copy of `variable`, as numpy arrays."""
  inner = getattr(variable, "value", variable)
  try:
    copies = strategy.experimental_local_results(inner)
  except (ValueError, TypeError):
    copies = (inner,)
  return [np.asarray(c.numpy() if hasattr(c, "numpy") else c) for c in copies]


def _snapshot(variables):
  return [np.array(v.numpy()) for v in variables]


def _restore(variables, values):
  for v, value in zip(variables, values):
    v.assign(value)


def _state_variables(trainer):
  state = list(trainer.model.variables) + list(trainer.optimizer.variables)
  step = getattr(trainer, "global_step", None)
  # What a step of the run changes besides: the EMA, the float16 loss scale
  # and the skip counters.
  ema = getattr(trainer, "ema", None)
  if ema is not None:
    state += list(ema.averages) + [ema.num_updates]
  loss_scale = getattr(trainer, "loss_scale", None)
  if loss_scale is not None:
    state += [loss_scale.scale, loss_scale.good_steps]
  state += [getattr(trainer, name) for name in
            ("skipped_steps", "consecutive_skips") if hasattr(trainer, name)]
  return state + ([step] if step is not None else [])


def _copy_state(source, target, variables_of):
  pairs = list(zip(variables_of(source), variables_of(target)))
  if len(variables_of(source)) != len(variables_of(target)):
    raise ConfigError(
        f"the trainer has {len(variables_of(source))} variables but the "
        f"reference has {len(variables_of(target))}: make_reference must "
        "build the same model")
  for s, t in pairs:
    if tuple(s.shape) != tuple(t.shape):
      raise ConfigError(f"variable {s.path} has shape {tuple(s.shape)} but "
                        f"the reference's {t.path} has {tuple(t.shape)}")
    t.assign(s.numpy())


def _probe_optimizer(trainer):
  with trainer.strategy.scope():
    probe = keras.optimizers.SGD(learning_rate=1.0, momentum=PROBE_MOMENTUM)
    probe.build(trainer.model.trainable_variables)
  return probe


def _run_steps(trainer, batches, draws=None):
  """One call of `trainer.train_step` per batch, each from the same state.

  Returns what each call changed; the state is put back after each. The
  random ops left in each traced step are noted in `draws`.
  """
  strategy = trainer.strategy
  model, optimizer = trainer.model, trainer.optimizer
  model_vars, opt_vars = list(model.variables), list(optimizer.variables)

  # A trainer whose step is not `strategy.run(train_step)` (a model split
  # with its own schedule) provides `distributed_train_step(dist_batch)`,
  # returning the per-replica outputs before the SUM.
  custom = getattr(trainer, "distributed_train_step", None)

  @tf.function
  def step(dist_batch):
    # Exactly what `Trainer._one_step` runs, minus the SUM, which is done
    # below so that each replica's share stays visible.
    if custom is not None:
      outputs = custom(dist_batch) or {}
    else:
      outputs = strategy.run(trainer.train_step, args=(dist_batch,)) or {}
    if draws is not None:
      draws.scan(tf.compat.v1.get_default_graph())
    return {k: tf.stack([tf.cast(tf.reshape(t, []), tf.float32) for t in
                         strategy.experimental_local_results(v)])
            for k, v in outputs.items()}

  outcomes = []
  for batch in batches:
    before = _snapshot(model_vars)
    opt_before = _snapshot(opt_vars)
    dataset = tf.data.Dataset.from_tensors(batch)
    dist_batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
    metrics = {k: v.numpy() for k, v in step(dist_batch).items()}
    deltas, spreads = [], []
    for var, old in zip(model_vars, before):
      copies = _local_values(strategy, var)
      if not np.issubdtype(old.dtype, np.floating):
        deltas.append(None)
        spreads.append(0.0)
        continue
      deltas.append(copies[0].astype(np.float64) - old)
      spreads.append(max(float(np.max(np.abs(c - copies[0]), initial=0.0))
                         for c in copies))
    opt_deltas = [np.asarray(v.numpy(), np.float64) - old
                  for v, old in zip(opt_vars, opt_before)]
    outcomes.append(Outcome(
        names=[v.path for v in model_vars],
        trainable=[v.trainable for v in model_vars], deltas=deltas,
        spreads=spreads, opt_names=[v.path for v in opt_vars],
        opt_deltas=opt_deltas, metrics=metrics))
    _restore(model_vars, before)
    _restore(opt_vars, opt_before)
  return outcomes


def _other_batch(batch):
  """Other data of the same shape: the first half, each example twice."""
  def halve(x):
    size = tf.shape(x)[0]
    return tf.gather(x, tf.range(size) // 2)
  return tf.nest.map_structure(halve, batch)


def _as_one_device(batch, replicas, micro_batches):
  """`batch` reordered so that one device's K micro-batches hold the examples
  of the N replicas' K micro-batches: micro-batch k on one device is replica
  0's k-th, then replica 1's k-th, ... (gradient accumulation with BatchNorm
  normalises over a micro-batch, so the sets must match; sums do not care
  about the order)."""
  if replicas == 1 or micro_batches == 1:
    return batch

  def reorder(x):
    x = tf.convert_to_tensor(x)
    parts = tf.reshape(x, [replicas, micro_batches, -1] + x.shape[1:].as_list())
    return tf.reshape(tf.transpose(parts, [1, 0] + list(
        range(2, parts.shape.rank))), tf.shape(x))
  return tf.nest.map_structure(reorder, batch)


def _regularisation_gradients(model):
  """d(sum of model.losses)/d(variable) at the current weights, or None."""
  variables = model.trainable_variables
  with tf.GradientTape() as tape:
    losses = model.losses
    if not losses:
      return [None] * len(variables)
    total = tf.add_n([tf.cast(l, tf.float32) for l in losses])
  grads = tape.gradient(total, variables)
  return [None if g is None else np.asarray(g, np.float64) for g in grads]


# --- Public API. -------------------------------------------------------------


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
  `optimizer` and `train_step` (run as `strategy.run(train_step)`, or the
  trainer's own `distributed_train_step(dist_batch)` if it has one).

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

  saved = None if owned else _snapshot(_state_variables(trainer))
  saved_optimizer = trainer.optimizer
  undo = []
  replicas = strategy.num_replicas_in_sync
  clip_norm = getattr(trainer, "clip_norm", None)
  try:
    undo_t, dropouts, unsynced, noisy = _prepare_model(trainer.model)
    undo_r, _, _, _ = _prepare_model(reference.model)
    undo = undo_t + undo_r
    if probe_optimizer:
      trainer.optimizer = _probe_optimizer(trainer)
      reference.optimizer = _probe_optimizer(reference)
    _copy_state(trainer, reference,
                lambda t: list(t.model.variables) +
                ([] if probe_optimizer else list(t.optimizer.variables)))
    reg_grads = _regularisation_gradients(reference.model)
    # The reference also runs on the batch in reverse order: the same math
    # with another float summation order, which measures the rounding noise
    # of this model (BatchNorm's backward pass, for one, amplifies it).
    micro_batches = getattr(trainer, "grad_accum_steps", 1)
    one_device = lambda b: _as_one_device(b, replicas, micro_batches)
    reversed_batch = tf.nest.map_structure(lambda x: tf.reverse(x, [0]),
                                           one_device(batch))
    # Random ops draw their mean on both sides while the steps are traced.
    with distribution_randomness.neutralised() as draws:
      ref_out, noise_out = _run_steps(reference, [one_device(batch),
                                                  reversed_batch], draws)
      dist_out, = _run_steps(trainer, [batch], draws)
      rows, causes = compare(dist_out, ref_out, noise_out, replicas, rtol,
                             atol, reg_grads, clip_norm, probe_optimizer)
      if "update_mismatch" in [c.code for c in causes]:
        # Unexplained: does the difference depend on the data at all?
        other = _other_batch(batch)
        other_out = (_run_steps(trainer, [other], draws)[0],
                     _run_steps(reference, [one_device(other)], draws)[0])
        rows, causes = compare(dist_out, ref_out, noise_out, replicas, rtol,
                               atol, reg_grads, clip_norm, probe_optimizer,
                               other=other_out)
  finally:
    trainer.optimizer = saved_optimizer
    for layer, attr, value in undo:
      setattr(layer, attr, value)
    if saved is not None:
      _restore(_state_variables(trainer), saved)

  warnings = []
  if unsynced and replicas > 1:
    warnings.append(Finding(
        "batch_norm_unsynchronized",
        f"BatchNormalization without synchronisation ({', '.join(unsynced)}):"
        f" each of the {replicas} replicas normalises with the statistics of "
        "its own part of the batch, so training differs from one device "
        "(the check synchronised them to compare the rest); use "
        "synchronized=True (--sync_batch_norm)"))
  if dropouts:
    warnings.append(Finding(
        "dropout",
        f"dropout ({', '.join(dropouts)}) draws different masks per device; "
        "the check ran with dropout off, so it is not covered"))
  randoms = _random_layers(trainer.model)
  if noisy or randoms:
    handled = ([f"{', '.join(noisy)} switched off"] if noisy else []) + (
        [f"{', '.join(randoms)} drawing their mean"] if randoms else [])
    warnings.append(Finding(
        "random_layers",
        f"layers drawing random numbers ({'; '.join(handled)}) would draw "
        "different numbers on each device; the check compared the rest "
        "without their noise, so the noise itself is not covered"))
  if draws.replaced_ops:
    warnings.append(Finding(
        "random_ops",
        f"random ops in the step ({'; '.join(draws.replaced_ops)}) draw "
        "different numbers on each device; the check replaced their draws by "
        f"the distribution's centre ({distribution_randomness.NORMAL:g} for "
        f"normal, {distribution_randomness.UNIFORM:g} for uniform [0, 1)) on "
        "both sides, so the rest is compared exactly and the random values "
        "are not"))
  compute_dtype = str(getattr(trainer.model, "compute_dtype", ""))
  if compute_dtype in ("bfloat16", "float16"):
    warnings.append(Finding(
        "low_precision",
        f"the model computes in {compute_dtype}, whose rounding can move one step "
        f"by several % between {replicas} replicas and one device (BatchNorm "
        "amplifies it) beyond the tolerance; build both sides in float32 to "
        "check the distribution (--check_distribution does)"))
  warnings.extend(notes)
  if draws.left_ops:
    warnings.append(Finding(
        "random_ops_left",
        f"random ops in the step that the check cannot replace "
        f"({'; '.join(draws.left_ops)}) still draw different numbers on each "
        "device: a difference they feed may be theirs, not a bug"))
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
  header = (f"distribution check: {_describe(trainer)} vs "
            f"{_describe(reference)}, one step, same global batch"
            f"{', probe optimizer SGD' if probe_optimizer else ''}")
  report = CheckReport(verdict, causes, warnings, rows, header,
                       time.perf_counter() - start)
  if print_fn is not None:
    print_fn(report.table())
  return report


def check_trainer_class(trainer_cls, build_model, make_optimizer, strategy,
                        batch, *, reference_strategy=None, seed=0,
                        **kwargs):
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
