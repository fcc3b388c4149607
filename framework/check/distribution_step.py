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

import contextlib
import inspect
import keras
import numpy as np
import os
import re
import sysconfig
import tensorflow as tf
import threading
import traceback
from framework import _tf_internal
from framework.check.distribution_diagnosis import Finding
from framework.check.distribution_diagnosis import Outcome
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
    # The default step also trains tracked models (Trainer.trainable_variables).
    probe.build(getattr(trainer, "trainable_variables", None)
                or trainer.model.trainable_variables)
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


# Keras layers that only add noise in training, and the attribute that turns
# the noise off when 0 (their `call` then draws nothing).
NOISE_LAYERS = ((keras.layers.GaussianNoise, "stddev"),
                (keras.layers.GaussianDropout, "rate"),
                (keras.layers.AlphaDropout, "rate"))


def prepare_model(model):
  """Dropout and noise off, BatchNorm synchronised.

  Returns:
    (undo, dropouts, unsynchronised BatchNorms, noise layers): `undo` is
    [(layer, attribute, value)] to put back; the rest layer names.
  """
  undo, dropouts, unsynced, noisy = [], [], [], []
  for layer in _tf_internal.flatten_layers(model):
    if isinstance(layer, keras.layers.Dropout) and layer.rate > 0:
      dropouts.append(layer.name)
      undo.append((layer, "rate", layer.rate))
      layer.rate = 0.0
    for cls, attr in NOISE_LAYERS:
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


def put_back(undo):
  """Undoes `prepare_model`."""
  for layer, attr, value in undo:
    setattr(layer, attr, value)


def random_layers(model):
  """Layers other than dropout and noise that draw random numbers."""
  switched_off = (keras.layers.Dropout,) + tuple(c for c, _ in NOISE_LAYERS)
  return [l.name for l in _tf_internal.flatten_layers(model)
          if _tf_internal.has_seed_generator(l)
          and not isinstance(l, switched_off)]


def layer_warnings(model, replicas, dropouts, unsynced, noisy):
  """The warnings about what `prepare_model` switched, and random layers."""
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
  randoms = random_layers(model)
  if noisy or randoms:
    handled = ([f"{', '.join(noisy)} switched off"] if noisy else []) + (
        [f"{', '.join(randoms)} drawing their mean"] if randoms else [])
    warnings.append(Finding(
        "random_layers",
        f"layers drawing random numbers ({'; '.join(handled)}) would draw "
        "different numbers on each device; the check compared the rest "
        "without their noise, so the noise itself is not covered"))
  return warnings


# The generated op wrappers: TensorFlow's own random functions call them
# through these modules, so replacing a module attribute replaces the op.
gen_random_ops = _tf_internal.random_op_module("gen_random_ops")
gen_stateful_random_ops = _tf_internal.random_op_module(
    "gen_stateful_random_ops")
gen_stateless_random_ops = _tf_internal.random_op_module(
    "gen_stateless_random_ops")
gen_stateless_random_ops_v2 = _tf_internal.random_op_module(
    "gen_stateless_random_ops_v2")

NORMAL, UNIFORM = 0.0, 0.5

# (module, wrapper) -> (op type, constant drawn instead).
_NEUTRAL = {
    (gen_random_ops, "random_standard_normal"): ("RandomStandardNormal",
                                                 NORMAL),
    (gen_random_ops, "truncated_normal"): ("TruncatedNormal", NORMAL),
    (gen_random_ops, "random_uniform"): ("RandomUniform", UNIFORM),
    (gen_stateless_random_ops, "stateless_random_normal"): (
        "StatelessRandomNormal", NORMAL),
    (gen_stateless_random_ops, "stateless_truncated_normal"): (
        "StatelessTruncatedNormal", NORMAL),
    (gen_stateless_random_ops, "stateless_random_uniform"): (
        "StatelessRandomUniform", UNIFORM),
    (gen_stateless_random_ops_v2, "stateless_random_normal_v2"): (
        "StatelessRandomNormalV2", NORMAL),
    (gen_stateless_random_ops_v2, "stateless_truncated_normal_v2"): (
        "StatelessTruncatedNormalV2", NORMAL),
    (gen_stateless_random_ops_v2, "stateless_random_uniform_v2"): (
        "StatelessRandomUniformV2", UNIFORM),
    (gen_stateful_random_ops, "stateful_standard_normal"): (
        "StatefulStandardNormal", NORMAL),
    (gen_stateful_random_ops, "stateful_standard_normal_v2"): (
        "StatefulStandardNormalV2", NORMAL),
    (gen_stateful_random_ops, "stateful_truncated_normal"): (
        "StatefulTruncatedNormal", NORMAL),
    (gen_stateful_random_ops, "stateful_uniform"): ("StatefulUniform",
                                                    UNIFORM),
}

# Every op type that draws random numbers (looked for in the traced graph).
RANDOM_OP_TYPES = frozenset(
    [op for op, _ in _NEUTRAL.values()] + [
        "RandomUniformInt", "ParameterizedTruncatedNormal", "RandomShuffle",
        "Multinomial", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
        "StatelessRandomUniformInt", "StatelessRandomUniformFullInt",
        "StatelessMultinomial", "StatelessRandomBinomial",
        "StatelessRandomGammaV2", "StatelessRandomGammaV3",
        "StatelessRandomPoisson", "StatelessParameterizedTruncatedNormal",
        "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2",
        "StatelessShuffle", "RandomIndexShuffle", "StatefulUniformInt",
        "StatefulUniformFullInt", "StatefulRandomBinomial",
        "NonDeterministicInts", "RandomCrop", "SampleDistortedBoundingBox",
        "SampleDistortedBoundingBoxV2", "StatelessSampleDistortedBoundingBox"])

_REPLICA_SCOPE = re.compile(r"^(replica_\d+/)+")
# Frames in these folders are libraries, not the step being checked.
_LIBRARY_DIRS = tuple(
    os.path.join(os.path.realpath(p), "")
    for p in {sysconfig.get_path(k) for k in ("stdlib", "purelib", "platlib")})


def _caller():
  """'file.py:line in function' of the innermost frame outside libraries."""
  for frame in reversed(traceback.extract_stack()[:-2]):
    path = os.path.realpath(frame.filename)
    if path.startswith(_LIBRARY_DIRS) or path == os.path.realpath(__file__):
      continue
    if os.path.basename(path).startswith("__autograph_generated"):
      # AutoGraph's converted copy: its file and line mean nothing.
      return frame.name.removeprefix("tf__")
    return f"{os.path.basename(path)}:{frame.lineno} in {frame.name}"
  return "?"


class Draws:
  """What the traced steps drew: replaced ops, and random ops left in."""

  def __init__(self):
    self._lock = threading.Lock()
    self._replaced, self._left = {}, {}

  def _add(self, table, op_type, where):
    with self._lock:
      table.setdefault(op_type, set()).add(where)

  def replaced(self, op_type, scope):
    self._add(self._replaced, op_type,
              f"{_caller()} (scope {_scope(scope)})")

  def scan(self, graph):
    """Notes the random ops in `graph` and the functions it calls."""
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
      nodes.extend(function.node_def)
    for node in nodes:
      if node.op in RANDOM_OP_TYPES:
        self._add(self._left, node.op,
                  f"node {_scope(node.name)}")

  @property
  def replaced_ops(self):
    return _describe(self._replaced)

  @property
  def left_ops(self):
    return _describe(self._left)


def _scope(name):
  # One entry per place in the step: replica k's copy is the same place.
  return _REPLICA_SCOPE.sub("", name) or "(top level)"


def _describe(table):
  """'RandomStandardNormal at noisy/random_normal, ...' (sorted)."""
  return [f"{op} at {', '.join(sorted(places))}"
          for op, places in sorted(table.items())]


def _neutral(original, op_type, value, draws):
  signature = inspect.signature(original)

  def draw(*args, **kwargs):
    if tf.executing_eagerly():
      return original(*args, **kwargs)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    dtype = tf.as_dtype(bound.arguments["dtype"])
    if not dtype.is_floating:
      return original(*args, **kwargs)
    draws.replaced(op_type, tf.compat.v1.get_default_graph().get_name_scope())
    shape = tf.cast(bound.arguments["shape"], tf.int64)
    return tf.fill(shape, tf.constant(value, dtype),
                   name=bound.arguments.get("name") or op_type)
  return draw


@contextlib.contextmanager
def neutralised():
  """Within: random ops traced draw their mean; yields the `Draws`.

  Replaces module attributes of TensorFlow for the whole process while
  inside: use it around the check's own tracing only.
  """
  draws = Draws()
  saved = []
  try:
    for (module, name), (op_type, value) in _NEUTRAL.items():
      original = getattr(module, name)
      saved.append((module, name, original))
      setattr(module, name, _neutral(original, op_type, value, draws))
    yield draws
  finally:
    for module, name, original in saved:
      setattr(module, name, original)
