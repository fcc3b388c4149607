"""Proves that a train step trains the same on N replicas as on one device.

The common bugs of custom loops under `tf.distribute` are silent: training
runs, just wrongly. This check runs ONE training step, the one the
training loop runs (`Trainer.run_step`: `train_step` on every replica and
the SUM of its outputs; `distribution_step`), on the same global batch from
the same starting state twice, under the chosen strategy (or model split)
and on a single device, and compares what changed:

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

import time

import keras
import tensorflow as tf

from framework.check import distribution_layers, distribution_randomness
from framework.check import distribution_step as steps
from framework.check.distribution_diagnosis import compare
from framework.check.distribution_report import (  # pylint: disable=unused-import
    FAIL, PASS, WARN, CheckReport, DistributionCheckError, verdict_of)
from framework.check.distribution_step import PROBE_MOMENTUM  # pylint: disable=unused-import
from framework.core.config import TrainerConfig
from framework.data.config import InputConfig
from framework.distribute import strategies
from framework.errors import ConfigError
from framework.settings import default


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
    undo_t, dropouts, unsynced, noisy = distribution_layers.prepare_model(
        trainer.model)
    undo = undo_t + distribution_layers.prepare_model(reference.model)[0]
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
    with distribution_randomness.neutralised() as draws:
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
    distribution_layers.put_back(undo)
    if saved is not None:
      steps.restore(steps.state_variables(trainer), saved)

  verdict, causes, warnings = verdict_of(
      causes, distribution_layers.layer_warnings(
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
