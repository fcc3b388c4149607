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
a pattern, from which the likely cause is named (N replicas, update ratio
distributed / single device):

    update ×N, loss ×N            loss averaged over the per-replica batch
    update ×N, loss equal         gradients all-reduced twice
    update ×1/N                   gradient shares averaged instead of summed
    only regularised layers       regularisation loss added on every replica
    differ only with clipping     gradient clipped per replica
    replica copies differ         gradients not all-reduced
    a metric from replica 0 only  the other replicas returned 0
    a metric ×N                   a per-replica value returned as a share

By default both runs use a probe optimizer, SGD(learning_rate=1,
momentum=0.9): its first update is exactly minus the applied gradient, so the
ratios above are exact whatever optimizer the run uses (Adam's first step,
for one, hides a gradient scale). Given equal gradients every optimizer's
update is the same on N replicas and on one, because `Trainer.apply_gradients`
applies the reduced gradient once. Dropout is switched off and BatchNorm
synchronised for the duration of the check (their randomness and per-replica
statistics are expected differences, reported as warnings), so that the rest
is still compared exactly. Everything is put back afterwards.

Float32 rounding differs between N replicas and one device (sums are split
differently), and some models amplify it: BatchNorm's backward pass turns
1e-7 into 1e-2 on a CIFAR CNN. So the reference step also runs on the batch
in reverse order (the same math, another summation order); a group fails when
its relative L2 difference exceeds max(rtol, 10 × the largest noise of any
group), capped at 5%, so a wrong factor of N always fails.
"""

import dataclasses
import time

import keras
import numpy as np
import tensorflow as tf

from framework import strategies
from framework.errors import ConfigError, DistloopError

PASS, WARN, FAIL = "pass", "warn", "fail"
PROBE_MOMENTUM = 0.9
NOISE_FACTOR = 10.0    # tolerance = max(rtol, NOISE_FACTOR × rounding noise)
MAX_TOLERANCE = 0.05   # ... but at most this (relative L2)


class DistributionCheckError(DistloopError):
  """The distribution check failed: the step trains differently on N replicas."""


@dataclasses.dataclass(frozen=True)
class Finding:
  """A named cause (a failure) or a warning, with advice in words."""
  code: str
  message: str


@dataclasses.dataclass(frozen=True)
class Row:
  """One line of the table: the differences of a group of values.

  `max_rel` is max|diff| / max|reference|; `rel_l2` is |diff| / |reference|
  (L2 norms), which decides `ok`: float rounding can flip a ReLU or max-pool
  choice, making a few elements differ a lot and the norm hardly at all.
  """
  section: str
  name: str
  max_abs: float
  max_rel: float
  rel_l2: float
  tolerance: float
  ok: bool


class _Diff:
  """Accumulates the differences of one group."""

  def __init__(self):
    self.max_abs = self.max_ref = self.sq_diff = self.sq_ref = 0.0

  def add(self, dist, ref):
    diff = np.asarray(dist, np.float64) - np.asarray(ref, np.float64)
    self.max_abs = max(self.max_abs, _max_abs(diff))
    self.max_ref = max(self.max_ref, _max_abs(ref))
    self.sq_diff += float(np.sum(diff * diff))
    self.sq_ref += float(np.sum(np.square(np.asarray(ref, np.float64))))
    return self

  @property
  def rel_l2(self):
    return _safe_ratio(np.sqrt(self.sq_diff), np.sqrt(self.sq_ref))

  def row(self, section, name, tolerance, atol):
    rel_max = _safe_ratio(self.max_abs, self.max_ref)
    return Row(section, name, self.max_abs, rel_max, self.rel_l2, tolerance,
               self.rel_l2 <= tolerance or self.max_abs <= atol)


def _safe_ratio(num, den):
  if den:
    return float(num / den)
  return 0.0 if num == 0 else float("inf")


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
  return list(model._flatten_layers(include_self=False))  # pylint: disable=protected-access


def _prepare_model(model):
  """Dropout off, BatchNorm synchronised; returns (undo, dropouts, bns)."""
  undo, dropouts, unsynced = [], [], []
  for layer in _layers(model):
    if isinstance(layer, keras.layers.Dropout) and layer.rate > 0:
      dropouts.append(layer.name)
      undo.append((layer, "rate", layer.rate))
      layer.rate = 0.0
    if (isinstance(layer, keras.layers.BatchNormalization) and
        not layer.synchronized):
      unsynced.append(layer.name)
      undo.append((layer, "synchronized", False))
      layer.synchronized = True
  return undo, dropouts, unsynced


def _random_layers(model):
  """Layers other than Dropout that draw random numbers in training."""
  return [l.name for l in _layers(model)
          if getattr(l, "seed_generator", None) is not None
          and not isinstance(l, keras.layers.Dropout)]


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


@dataclasses.dataclass
class _Outcome:
  names: list           # model variable paths
  trainable: list       # bool per model variable
  deltas: list          # after - before, per model variable (float only)
  spreads: list         # max spread between replica copies
  opt_names: list
  opt_deltas: list
  metrics: dict         # name -> per-replica shares (np array)


def _probe_optimizer(trainer):
  with trainer.strategy.scope():
    probe = keras.optimizers.SGD(learning_rate=1.0, momentum=PROBE_MOMENTUM)
    probe.build(trainer.model.trainable_variables)
  return probe


def _run_steps(trainer, batches):
  """One call of `trainer.train_step` per batch, each from the same state.

  Returns what each call changed; the state is put back after each.
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
    outcomes.append(_Outcome(
        names=[v.path for v in model_vars],
        trainable=[v.trainable for v in model_vars], deltas=deltas,
        spreads=spreads, opt_names=[v.path for v in opt_vars],
        opt_deltas=opt_deltas, metrics=metrics))
    _restore(model_vars, before)
    _restore(opt_vars, opt_before)
  return outcomes


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


# --- Comparing and diagnosing. -----------------------------------------------


def _group(path):
  return path.rsplit("/", 1)[0] if "/" in path else path


def _max_abs(x):
  return float(np.max(np.abs(x), initial=0.0))


def _flat(arrays, indices):
  return np.concatenate([np.ravel(arrays[i]) for i in indices] or
                        [np.zeros(0)])


def _gradient_scales(applied, expected, reg):
  """(a, b, misfit): applied ≈ a·(data gradient) + b·(regularisation one).

  `expected` = data + regularisation gradient on one device; `reg` the
  regularisation gradient. Without regularisation b = a.
  """
  data = expected - reg
  if not np.any(reg):
    norm = float(data @ data)
    if norm == 0.0:
      return None, None, None
    a = float(applied @ data) / norm
    b, fit = a, a * data
  else:
    basis = np.stack([data, reg], axis=1)
    (a, b), *_ = np.linalg.lstsq(basis, applied, rcond=None)
    a, b, fit = float(a), float(b), basis @ np.array([a, b])
  scale = max(float(np.linalg.norm(applied)), 1e-30)
  return a, b, float(np.linalg.norm(applied - fit)) / scale


def _near(value, target, tol=0.05):
  return value is not None and abs(value - target) <= tol * abs(target)


def _compare(dist, ref, noise, replicas, rtol, atol, reg_grads, clip_norm,
             probe):
  """(rows, causes): `dist` against `ref`, `noise` the rounding noise."""
  rows, causes = [], []
  n = replicas

  def tolerance_of(noise_rel_l2):
    # Several times the rounding noise, never loose enough to pass a factor.
    return min(max(rtol, NOISE_FACTOR * noise_rel_l2), MAX_TOLERANCE)

  # Weights: the update per layer, and replica copies.
  groups, noise_groups, per_variable = {}, {}, []
  for i, (name, trainable) in enumerate(zip(dist.names, dist.trainable)):
    d, r, e = dist.deltas[i], ref.deltas[i], noise.deltas[i]
    if d is None:
      continue
    key = ("update" if trainable else "state", _group(name))
    groups.setdefault(key, _Diff()).add(d, r)
    noise_groups.setdefault(key, _Diff()).add(e, r)
    if trainable:
      per_variable.append(i)
  # Rounding noise amplified in one layer (BatchNorm) reaches the others
  # through the forward pass: one tolerance, from the noisiest group.
  worst = max((g.rel_l2 for g in noise_groups.values()), default=0.0)
  tol = tolerance_of(worst)
  for key, diff in groups.items():
    rows.append(diff.row(*key, tol, atol))
  failing = {(r.section, r.name) for r in rows if not r.ok}
  bad_vars = [i for i in per_variable
              if ("update", _group(dist.names[i])) in failing]
  state_bad = [r for r in rows if r.section == "state" and not r.ok]
  # Copies of a variable must be identical: they all apply the same update.
  spread = max(dist.spreads, default=0.0)
  scale_all = max((_max_abs(d) for d in ref.deltas if d is not None),
                  default=0.0)
  spread_rel = _safe_ratio(spread, scale_all)
  spread_ok = spread_rel <= rtol or spread <= atol
  rows.append(Row("replicas", "copies of each variable", spread, spread_rel,
                  spread_rel, rtol, spread_ok))

  # Optimizer variables, grouped by slot kind.
  opt_groups, opt_noise = {}, {}
  slot_prefixes = sorted((p.replace("/", "_") + "_" for p, t in
                          zip(dist.names, dist.trainable) if t),
                         key=len, reverse=True)
  steps_taken = None
  for name, d, r, e in zip(dist.opt_names, dist.opt_deltas, ref.opt_deltas,
                           noise.opt_deltas):
    leaf = kind = name.rsplit("/", 1)[-1]
    for prefix in slot_prefixes:  # "<variable path>_<slot>" -> "<slot>"
      if leaf.startswith(prefix):
        kind = leaf[len(prefix):]
        break
    if kind in ("iteration", "iterations"):
      steps_taken = float(np.max(d))
    opt_groups.setdefault(kind, _Diff()).add(d, r)
    opt_noise.setdefault(kind, _Diff()).add(e, r)
  for kind, diff in opt_groups.items():
    rows.append(diff.row("optimizer", kind,
                         max(tol, tolerance_of(opt_noise[kind].rel_l2)), atol))

  # Metrics: the SUM of shares, as the trainer reports them.
  metric_bad = {}
  ref_metrics = {k: float(np.sum(v)) for k, v in ref.metrics.items()}
  for k, shares in dist.metrics.items():
    value = float(np.sum(shares))
    expected = ref_metrics.get(k)
    if expected is None:
      nan = float("nan")
      rows.append(Row("metric", f"{k} (not in reference)", nan, nan, nan,
                      rtol, False))
      metric_bad[k] = (value, None, shares)
      continue
    noise_diff = _Diff().add(float(np.sum(noise.metrics[k])), expected)
    row = _Diff().add(value, expected).row(
        "metric", k, tolerance_of(noise_diff.rel_l2), atol)
    rows.append(row)
    if not row.ok:
      metric_bad[k] = (value, expected, shares)

  # --- Causes, from the pattern. ---
  if steps_taken is not None and steps_taken != 1:
    causes.append(Finding(
        "optimizer_steps",
        f"the optimizer stepped {steps_taken:g} times in one train step on "
        f"{n} replicas (1 on one device): apply the gradients once, with "
        "self.apply_gradients, outside any per-replica branch"))
  if not spread_ok:
    causes.append(Finding(
        "not_all_reduced",
        f"replicas hold different weights after one step (spread "
        f"{spread:.3g}): each replica applied its own gradient; SUM them "
        "first with self.all_reduce(grads)"))
  explained_loss = False
  if bad_vars and spread_ok:
    trainable = [i for i, t in enumerate(dist.trainable)
                 if t and dist.deltas[i] is not None]
    reg_full = _full(reg_grads, dist)
    applied = -_flat(dist.deltas, trainable)  # probe: update = -gradient
    expected = -_flat(ref.deltas, trainable)
    reg = _flat([g if g is not None else np.zeros_like(dist.deltas[i])
                 for i, g in enumerate(reg_full)], trainable)
    a, b, misfit = _gradient_scales(applied, expected, reg)
    has_reg = bool(np.any(reg))
    loss_ratio = None
    if "loss" in metric_bad and metric_bad["loss"][1]:
      loss_ratio = metric_bad["loss"][0] / metric_bad["loss"][1]
    ref_norm = float(np.linalg.norm(expected))
    clipping = (probe and clip_norm is not None and
                _near(ref_norm, clip_norm, 1e-3))
    fits = a is not None and misfit < 1e-2
    data_n, reg_n = fits and _near(a, n), fits and _near(b, n)
    reg_1 = fits and _near(b, 1.0)
    if data_n and ((has_reg and reg_1) or _near(loss_ratio, n)):
      explained_loss = True
      causes.append(Finding(
          "loss_per_replica_mean",
          f"the data-loss gradient is {a:.3g}x the single-device one: the "
          "loss is averaged over the per-replica batch (tf.reduce_mean or a "
          "Keras loss object) instead of the global batch; use "
          "self.average(per_example_losses)"))
    elif data_n and reg_n:
      causes.append(Finding(
          "double_all_reduce",
          f"the whole gradient is {a:.3g}x the single-device one with the "
          "same loss: it is all-reduced twice (e.g. self.all_reduce and then "
          "optimizer.apply_gradients, which sums again); use self.all_reduce "
          "once and self.apply_gradients"))
    elif fits and _near(a, 1.0 / n) and _near(b, 1.0 / n):
      causes.append(Finding(
          "mean_all_reduce",
          f"the gradient is {a:.3g}x (1/{n}) the single-device one: the "
          "gradient shares are averaged (MEAN) instead of summed, or the "
          "loss is divided by the replica count twice"))
    elif fits and has_reg and _near(a, 1.0) and reg_n:
      explained_loss = True
      causes.append(Finding(
          "unscaled_regularization",
          f"only the regularisation gradient differs ({b:.3g}x): the "
          f"regularisation loss is added in full on each of the {n} replicas,"
          f" so it counts {n} times; add "
          "tf.nn.scale_regularization_loss(tf.add_n(model.losses))"))
    elif clipping:
      causes.append(Finding(
          "clip_before_reduce",
          f"the updates differ while clipping is active (single-device "
          f"gradient norm {ref_norm:.3g} = clip_norm {clip_norm:g}): the "
          "gradient is clipped per replica before the all-reduce; clip the "
          "reduced gradient (self.all_reduce, then self.clip_by_global_norm)"))
    elif fits and not (_near(a, 1.0) and _near(b, 1.0)):
      causes.append(Finding(
          "gradient_scale",
          f"the gradient is {a:.3g}x (data loss) and {b:.3g}x "
          "(regularisation) the single-device one: check the loss divisor "
          "and the reduction"))
    else:
      causes.append(Finding(
          "update_mismatch",
          "the weights differ beyond the rounding noise without a "
          "recognised pattern: look for computations over the per-replica "
          "batch (statistics, normalisation, sampling) or replica-dependent "
          "values"))
  if state_bad and not causes:
    causes.append(Finding(
        "state_mismatch",
        "non-trainable state (e.g. moving statistics) differs: it is updated "
        "from per-replica values"))
  for k, (value, expected, shares) in metric_bad.items():
    if k == "loss" and explained_loss:
      continue
    nonzero = np.flatnonzero(np.abs(shares) > 0)
    if expected is None:
      causes.append(Finding("metric_missing", f"metric '{k}' is returned on "
                            f"{n} replicas but not on one device"))
    elif n > 1 and len(nonzero) == 1 and expected != 0:
      causes.append(Finding(
          "metric_one_replica",
          f"metric '{k}' = {value:.4g} comes from replica {nonzero[0]} only "
          f"(the others returned 0); on one device it is {expected:.4g}. "
          "Return a share from every replica: self.average(per_example) or "
          "self.replica_share(value)"))
    elif _near(value / expected if expected else None, n):
      causes.append(Finding(
          "metric_not_shared",
          f"metric '{k}' is {value / expected:.3g}x the single-device value: "
          "each replica returned a whole value, which the trainer then sums; "
          "return self.average(per_example) or self.replica_share(value)"))
    elif _near(value / expected if expected else None, 1.0 / n):
      causes.append(Finding(
          "metric_divided_twice",
          f"metric '{k}' is {value / expected:.3g}x (1/{n}) the "
          "single-device value: it is divided by the replica count twice"))
    else:
      causes.append(Finding(
          "metric_mismatch",
          f"metric '{k}' = {value:.4g} on {n} replicas but {expected:.4g} on "
          "one device"))
  return rows, causes


def _full(reg_grads, outcome):
  """Regularisation gradients indexed like `outcome.names` (all variables)."""
  full, it = [], iter(reg_grads)
  for trainable in outcome.trainable:
    full.append(next(it, None) if trainable else None)
  return full


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
                       atol=1e-6, probe_optimizer=True, print_fn=print):
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
    rtol, atol: a group passes when |diff| <= rtol * |reference| (L2 norms)
      or max|diff| <= atol.
    probe_optimizer: run both with SGD(1, momentum 0.9) so that updates equal
      minus the applied gradient (exact ratios); False uses the trainers' own
      optimizers, whose state is copied too.
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
  try:
    undo_t, dropouts, unsynced = _prepare_model(trainer.model)
    undo_r, _, _ = _prepare_model(reference.model)
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
    reversed_batch = tf.nest.map_structure(lambda x: tf.reverse(x, [0]),
                                           batch)
    ref_out, noise_out = _run_steps(reference, [batch, reversed_batch])
    dist_out, = _run_steps(trainer, [batch])
  finally:
    trainer.optimizer = saved_optimizer
    for layer, attr, value in undo:
      setattr(layer, attr, value)
    if saved is not None:
      _restore(_state_variables(trainer), saved)

  replicas = strategy.num_replicas_in_sync
  rows, causes = _compare(dist_out, ref_out, noise_out, replicas, rtol, atol,
                          reg_grads,
                          getattr(trainer, "clip_norm", None), probe_optimizer)
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
  if randoms:
    warnings.append(Finding(
        "random_layers",
        f"layers drawing random numbers ({', '.join(randoms)}) differ per "
        "device; differences in what they feed are expected"))
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


def check_experiment(config, strategy, dataset, trainer_cls, *,
                     print_fn=print):
  """The check for an `ExperimentConfig` run (what `--check_distribution` does).

  Builds its own trainer under `strategy` and a reference on one device,
  exactly as `experiment.build` would, and checks them on the run's first
  global batch. The real run is untouched: `experiment.build` re-seeds.

  Raises:
    DistributionCheckError: the verdict is fail (the causes in the message).
  """
  # Imported here: models import framework modules.
  import models  # pylint: disable=g-import-not-at-top
  from framework import inputs, optimizers  # pylint: disable=g-import-not-at-top
  optimizer_config = config.optimizer
  if optimizer_config.schedule == "cosine" and not optimizer_config.total_steps:
    optimizer_config = dataclasses.replace(optimizer_config, total_steps=1)
  batch = next(iter(inputs.train_dataset(dataset, config.global_batch_size,
                                         seed=config.seed)))
  report = check_trainer_class(
      trainer_cls,
      lambda: models.build_model(config.model, dataset.input_shape,
                                 dataset.num_classes, **config.model_options),
      lambda: optimizers.make_optimizer(optimizer_config), strategy, batch,
      seed=config.seed, global_batch_size=config.global_batch_size,
      clip_norm=config.clip_norm, nan_policy=config.nan_policy,
      print_fn=print_fn)
  if report.verdict == FAIL:
    raise DistributionCheckError(
        "distribution check failed: " +
        "; ".join(f"{c.code}: {c.message}" for c in report.causes))
  return report
