"""Running the trainer's own step for the distribution check, from one state.

The check runs exactly what the training loop runs: a `Trainer`'s
`run_step(dist_batch)` (`framework.core.trainer`: the per-replica step,
its SUM over replicas, `global_step` + 1), so that a change to the step or
to the loop around it is checked, not a copy. A trainer without it (any
object with `strategy`, `model`, `optimizer` and `train_step`) runs its
`distributed_train_step(dist_batch)` if it has one, else
`strategy.run(train_step)`, and its shares are summed here.

Each call starts from the same state and records what it changed (an
`Outcome`: per-variable updates, the spread between a variable's replica
copies, optimizer deltas, per-replica metric shares and their SUM); the
state is put back afterwards.
"""

import keras
import numpy as np
import tensorflow as tf

from framework.check.distribution_differences import Outcome
from framework.core import protocols
from framework.errors import ConfigError

PROBE_MOMENTUM = 0.9


def _local_values(strategy, variable):
  """Every per-device copy of `variable`, as numpy arrays."""
  inner = getattr(variable, "value", variable)
  try:
    copies = strategy.experimental_local_results(inner)
  except (ValueError, TypeError):
    copies = (inner,)
  return [np.asarray(c.numpy() if hasattr(c, "numpy") else c) for c in copies]


def snapshot(variables):
  """The values of `variables` (numpy copies)."""
  return [np.array(v.numpy()) for v in variables]


def restore(variables, values):
  """Assigns `values` (from `snapshot`) back to `variables`."""
  for v, value in zip(variables, values):
    v.assign(value)


def state_variables(trainer):
  """What one step of `trainer` may change: its own `step_variables()`
  (a `Trainer`: the EMA, the loss scale and the skip counters too), else
  the model's and optimizer's variables and a `global_step` if any."""
  step_variables = protocols.optional(trainer, "step_variables")
  if step_variables is not None:
    return list(step_variables())
  state = list(trainer.model.variables) + list(trainer.optimizer.variables)
  step = getattr(trainer, "global_step", None)
  return state + ([step] if step is not None else [])


def copy_state(source, target, variables_of):
  """Assigns `variables_of(source)` to `variables_of(target)`, one by one."""
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


def probe_optimizer(trainer):
  """SGD(1, momentum 0.9) built on the trainer's variables: its first
  update is exactly minus the applied gradient."""
  with trainer.strategy.scope():
    probe = keras.optimizers.SGD(learning_rate=1.0, momentum=PROBE_MOMENTUM)
    probe.build(trainer.model.trainable_variables)
  return probe


def _step_of(trainer):
  """`dist_batch -> (per-replica outputs, their SUM or None)`."""
  if protocols.optional(trainer, "run_step") is not None:
    return trainer.run_step  # the loop's own step
  run = protocols.optional(trainer, "distributed_train_step")
  if run is None:
    run = lambda b: trainer.strategy.run(trainer.train_step, args=(b,))
  return lambda dist_batch: (run(dist_batch), None)


def _scalar(value):
  return tf.cast(tf.reshape(value, []), tf.float32)


def run_steps(trainer, batches, draws=None):
  """One step of `trainer` per batch, each from the same state.

  Returns an `Outcome` per batch; the state is put back after each. The
  random ops left in each traced step are noted in `draws`.
  """
  strategy = trainer.strategy
  model, optimizer = trainer.model, trainer.optimizer
  model_vars, opt_vars = list(model.variables), list(optimizer.variables)
  state = state_variables(trainer)
  run = _step_of(trainer)

  @tf.function
  def step(dist_batch):
    per_replica, totals = run(dist_batch)
    if draws is not None:
      draws.scan(tf.compat.v1.get_default_graph())
    # Each replica's share stays visible, beside the SUM the loop reports.
    shares = {k: tf.stack([_scalar(t) for t in
                           strategy.experimental_local_results(v)])
              for k, v in (per_replica or {}).items()}
    return shares, {k: _scalar(v) for k, v in (totals or {}).items()}

  steps_index = next((i for i, v in enumerate(opt_vars)
                      if v is optimizer.iterations), None)
  outcomes = []
  for batch in batches:
    saved = snapshot(state)
    before = snapshot(model_vars)
    opt_before = snapshot(opt_vars)
    dataset = tf.data.Dataset.from_tensors(batch)
    dist_batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
    shares, totals = step(dist_batch)
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
        opt_deltas=opt_deltas,
        metrics={k: v.numpy() for k, v in shares.items()},
        totals={k: float(v.numpy()) for k, v in totals.items()} or None,
        opt_steps=steps_index))
    restore(state, saved)
  return outcomes


def other_batch(batch):
  """Other data of the same shape: the first half, each example twice."""
  def halve(x):
    size = tf.shape(x)[0]
    return tf.gather(x, tf.range(size) // 2)
  return tf.nest.map_structure(halve, batch)


def as_one_device(batch, replicas, micro_batches):
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


def regularisation_gradients(model):
  """d(sum of model.losses)/d(variable) at the current weights, or None."""
  variables = model.trainable_variables
  with tf.GradientTape() as tape:
    losses = model.losses
    if not losses:
      return [None] * len(variables)
    total = tf.add_n([tf.cast(l, tf.float32) for l in losses])
  grads = tape.gradient(total, variables)
  return [None if g is None else np.asarray(g, np.float64) for g in grads]
