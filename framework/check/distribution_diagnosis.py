"""The table of the distribution check: how far one step under the strategy
is from the same step on one device, against the rounding noise.

Each group of values (a layer's update, its non-trainable state, an
optimizer slot kind, a metric) becomes a `Row`: its largest and relative
differences and whether they are within the tolerance, several times the
rounding noise measured by the same step on one device with the batch
reordered. `difference_table` also returns the `Differences` that the
causes are read from (`distribution_diagnosis`).
"""

import dataclasses
import numpy as np


NOISE_FACTOR = 10.0    # tolerance = max(rtol, NOISE_FACTOR × rounding noise)
MAX_TOLERANCE = 0.05   # ... but at most this (relative L2)
# A difference within NOISE_FACTOR x the rounding noise but above the cap
# is the model's rounding (deep BatchNorm stacks amplify it), if it stays
# below this: the distribution errors the check knows move an update by a
# factor (a relative difference of 0.5 or more on 2 replicas).
NOISE_LIMIT = 0.2


@dataclasses.dataclass(frozen=True)
class Row:
  """One line of the table: the differences of a group of values.

  `max_rel` is max|diff| / max|reference|; `rel_l2` is |diff| / |reference|
  (L2 norms), which decides `ok` against `tolerance` (from the measured
  rounding noise): a few elements may differ a lot when rounding flips a
  ReLU or max-pool choice, while the norm hardly moves.
  """
  section: str
  name: str
  max_abs: float
  max_rel: float
  rel_l2: float
  tolerance: float
  ok: bool


class Diff:
  """Accumulates the differences of one group."""

  def __init__(self):
    self.max_abs = self.max_ref = self.sq_diff = self.sq_ref = 0.0

  def add(self, dist, ref):
    diff = np.asarray(dist, np.float64) - np.asarray(ref, np.float64)
    self.max_abs = max(self.max_abs, max_abs(diff))
    self.max_ref = max(self.max_ref, max_abs(ref))
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
class Outcome:
  """What one train step changed (numpy), from `distribution_step`."""
  names: list           # model variable paths
  trainable: list       # bool per model variable
  deltas: list          # after - before, per model variable (float only)
  spreads: list         # max spread between replica copies
  opt_names: list
  opt_deltas: list
  metrics: dict         # name -> per-replica shares (np array)
  totals: dict = None   # name -> the SUM the trainer's loop reported (None:
                        # the shares' sum)
  opt_steps: int = None  # index of the optimizer's step counter

  def total(self, name):
    """The metric `name` as the trainer reports it."""
    if self.totals is not None and name in self.totals:
      return float(self.totals[name])
    return float(np.sum(self.metrics[name]))


@dataclasses.dataclass
class Differences:
  """What the causes are read from (beside the rows)."""
  tolerance: float      # of the updates: from the noisiest group
  noise: float          # that group's rounding noise (relative L2)
  uncapped: float       # the tolerance without MAX_TOLERANCE (NOISE_LIMIT)
  bad_variables: list   # indices of trainable variables in failing groups
  state_bad: bool       # a non-trainable state group fails
  spread: float         # the largest spread between replica copies
  spread_ok: bool
  steps_taken: float    # the optimizer's steps in the step (None: unknown)
  ref_steps: float      # ... on one device
  # metric -> (value, single-device value or None, per-replica shares)
  metric_bad: dict


def _group(path):
  return path.rsplit("/", 1)[0] if "/" in path else path


def max_abs(x):
  return float(np.max(np.abs(x), initial=0.0))


def difference_table(dist, ref, noise, rtol, atol):
  """(rows, Differences): `dist` against `ref`, `noise` the rounding noise."""
  rows = []

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
    groups.setdefault(key, Diff()).add(d, r)
    noise_groups.setdefault(key, Diff()).add(e, r)
    if trainable:
      per_variable.append(i)
  # Rounding noise amplified in one layer (BatchNorm) reaches the others
  # through the forward pass: one tolerance, from the noisiest group.
  worst = max((g.rel_l2 for g in noise_groups.values()), default=0.0)
  tol = tolerance_of(worst)
  for key, diff in groups.items():
    rows.append(diff.row(*key, tol, atol))
  failing = {(r.section, r.name) for r in rows if not r.ok}
  # Copies of a variable must be identical: they all apply the same update.
  spread = max(dist.spreads, default=0.0)
  scale_all = max((max_abs(d) for d in ref.deltas if d is not None),
                  default=0.0)
  spread_rel = _safe_ratio(spread, scale_all)
  spread_ok = spread_rel <= rtol or spread <= atol
  differences = Differences(
      tolerance=tol, noise=worst,
      uncapped=min(max(rtol, NOISE_FACTOR * worst), NOISE_LIMIT),
      bad_variables=[i for i in per_variable
                     if ("update", _group(dist.names[i])) in failing],
      state_bad=any(r.section == "state" and not r.ok for r in rows),
      spread=spread, spread_ok=spread_ok, steps_taken=None, ref_steps=None,
      metric_bad={})
  rows.append(Row("replicas", "copies of each variable", spread, spread_rel,
                  spread_rel, rtol, spread_ok))

  # Optimizer variables, grouped by slot kind.
  opt_groups, opt_noise = {}, {}
  slot_prefixes = sorted((p.replace("/", "_") + "_" for p, t in
                          zip(dist.names, dist.trainable) if t),
                         key=len, reverse=True)
  for i, (name, d, r, e) in enumerate(zip(
      dist.opt_names, dist.opt_deltas, ref.opt_deltas, noise.opt_deltas)):
    leaf = kind = name.rsplit("/", 1)[-1]
    for prefix in slot_prefixes:  # "<variable path>_<slot>" -> "<slot>"
      if leaf.startswith(prefix):
        kind = leaf[len(prefix):]
        break
    if i == dist.opt_steps:
      differences.steps_taken = float(np.max(d))
      differences.ref_steps = float(np.max(r))
    opt_groups.setdefault(kind, Diff()).add(d, r)
    opt_noise.setdefault(kind, Diff()).add(e, r)
  for kind, diff in opt_groups.items():
    rows.append(diff.row("optimizer", kind,
                         max(tol, tolerance_of(opt_noise[kind].rel_l2)), atol))

  # Metrics: the SUM of shares, as the trainer reports them.
  ref_metrics = {k: ref.total(k) for k in ref.metrics}
  for k, shares in dist.metrics.items():
    value = dist.total(k)
    expected = ref_metrics.get(k)
    if expected is None:
      nan = float("nan")
      rows.append(Row("metric", f"{k} (not in reference)", nan, nan, nan,
                      rtol, False))
      differences.metric_bad[k] = (value, None, shares)
      continue
    noise_diff = Diff().add(noise.total(k), expected)
    row = Diff().add(value, expected).row(
        "metric", k, tolerance_of(noise_diff.rel_l2), atol)
    rows.append(row)
    if not row.ok:
      differences.metric_bad[k] = (value, expected, shares)
  return rows, differences


# Causes that are warnings: the step is right, the check could not tell.
WARNING_CAUSES = ("rounding_noise",)
# Causes that explain a differing loss (no separate metric finding for it).
_EXPLAIN_LOSS = ("loss_per_replica_mean", "unscaled_regularization",
                 "data_independent_term", "unscaled_penalty",
                 "rounding_noise")


@dataclasses.dataclass(frozen=True)
class Finding:
  """A named cause (a failure) or a warning, with advice in words."""
  code: str
  message: str


def compare(dist, ref, noise, replicas, rtol, atol, reg_grads, clip_norm,
            probe, other=None):
  """(rows, causes): `dist` against `ref`, `noise` the rounding noise.

  `other`: (dist, ref) on other data, to tell a data-independent difference.
  """
  rows, found = difference_table(dist, ref, noise, rtol, atol)
  causes = _step_causes(found, replicas)
  if found.bad_variables and found.spread_ok:
    causes.append(_gradient_cause(dist, ref, rows, found, replicas,
                                  reg_grads, clip_norm, probe, other))
  if found.state_bad and not causes:
    causes.append(Finding(
        "state_mismatch",
        "non-trainable state (e.g. moving statistics) differs: it is updated "
        "from per-replica values"))
  metric_bad = dict(found.metric_bad)
  if any(c.code in _EXPLAIN_LOSS for c in causes):
    metric_bad.pop("loss", None)
  return rows, causes + _metric_causes(metric_bad, replicas)


def _step_causes(found, n):
  """The optimizer stepping other than once; replicas that diverged."""
  causes = []
  steps_taken, ref_steps = found.steps_taken, found.ref_steps
  if steps_taken is not None and (steps_taken != 1 or ref_steps != 1):
    advice = ("the step never applies its gradients: call "
              "self.apply_gradients(grads) once" if steps_taken == 0 else
              "apply the gradients once, with self.apply_gradients, outside "
              "any per-replica branch")
    causes.append(Finding(
        "optimizer_steps",
        f"in one train step the optimizer stepped {steps_taken:g} times on "
        f"{n} replicas and {ref_steps:g} times on one device (1 is right): "
        f"{advice}"))
  if not found.spread_ok:
    causes.append(Finding(
        "not_all_reduced",
        f"replicas hold different weights after one step (spread "
        f"{found.spread:.3g}): each replica applied its own gradient; SUM "
        "them first with self.all_reduce(grads)"))
  return causes


def _gradient_cause(dist, ref, rows, found, n, reg_grads, clip_norm, probe,
                    other):
  """The cause of updates that differ while the replicas agree: the
  gradient's scale against the single-device one (the module's table)."""
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
  if "loss" in found.metric_bad and found.metric_bad["loss"][1]:
    loss_ratio = found.metric_bad["loss"][0] / found.metric_bad["loss"][1]
  ref_norm = float(np.linalg.norm(expected))
  clipping = (probe and clip_norm is not None and
              _near(ref_norm, clip_norm, 1e-3))
  fits = a is not None and misfit < 1e-2
  data_n, reg_n = fits and _near(a, n), fits and _near(b, n)
  reg_1 = fits and _near(b, 1.0)
  if data_n and ((has_reg and reg_1) or _near(loss_ratio, n)):
    return Finding(
        "loss_per_replica_mean",
        f"the data-loss gradient is {a:.3g}x the single-device one: the "
        "loss is averaged over the per-replica batch (tf.reduce_mean or a "
        "Keras loss object) instead of the global batch; use "
        "self.average(per_example_losses)")
  if data_n and reg_n:
    return Finding(
        "double_all_reduce",
        f"the whole gradient is {a:.3g}x the single-device one with the "
        "same loss: it is all-reduced twice (e.g. self.all_reduce and then "
        "optimizer.apply_gradients, which sums again); use self.all_reduce "
        "once and self.apply_gradients")
  if fits and _near(a, 1.0 / n) and _near(b, 1.0 / n):
    return Finding(
        "mean_all_reduce",
        f"the gradient is {a:.3g}x (1/{n}) the single-device one: the "
        "gradient shares are averaged (MEAN) instead of summed, or the "
        "loss is divided by the replica count twice")
  if fits and has_reg and _near(a, 1.0) and reg_n:
    return Finding(
        "unscaled_regularization",
        f"only the regularisation gradient differs ({b:.3g}x): the "
        f"regularisation loss is added in full on each of the {n} replicas,"
        f" so it counts {n} times; add "
        "tf.nn.scale_regularization_loss(tf.add_n(model.losses))")
  if clipping:
    return Finding(
        "clip_before_reduce",
        f"the updates differ while clipping is active (single-device "
        f"gradient norm {ref_norm:.3g} = clip_norm {clip_norm:g}): the "
        "gradient is clipped per replica before the all-reduce; clip the "
        "reduced gradient (self.all_reduce, then self.clip_by_global_norm)")
  if fits and not (_near(a, 1.0) and _near(b, 1.0)):
    return Finding(
        "gradient_scale",
        f"the gradient is {a:.3g}x (data loss) and {b:.3g}x "
        "(regularisation) the single-device one: check the loss divisor "
        "and the reduction")
  offset = (None if other is None else
            _data_independent(dist, ref, other, trainable))
  if offset is not None:
    return _penalty_finding(offset, n)
  if found.tolerance < found.uncapped and max(
      (r.rel_l2 for r in rows if r.section == "update" and not r.ok),
      default=0.0) <= found.uncapped:
    largest = max((r for r in rows if r.section == "update" and not r.ok),
                  key=lambda r: r.rel_l2)
    return Finding(
        "rounding_noise",
        f"the updates differ by up to {largest.rel_l2:.3g} (relative L2, "
        f"{largest.name}), within {NOISE_FACTOR:g}x this model's float32 "
        f"rounding noise ({found.noise:.3g}, the same step on one device "
        "with the batch reordered) but above the check's "
        f"{MAX_TOLERANCE:g} cap: rounding amplified by the model (deep "
        "BatchNorm stacks do), not a distribution error of a known kind "
        "(those move an update by a factor); check at a smaller size to "
        "compare tighter")
  return Finding(
      "update_mismatch",
      "the weights differ beyond the rounding noise without a "
      "recognised pattern: look for computations over the per-replica "
      "batch (statistics, normalisation, sampling) or replica-dependent "
      "values")


def _metric_causes(metric_bad, n):
  """A cause per differing metric, from its value against one device's."""
  causes = []
  for k, (value, expected, shares) in metric_bad.items():
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
  return causes


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


def _offset(dist, ref, trainable):
  """(update difference, loss difference or None): dist - ref, flattened."""
  update = _flat(dist.deltas, trainable) - _flat(ref.deltas, trainable)
  loss = None
  if "loss" in dist.metrics and "loss" in ref.metrics:
    loss = dist.total("loss") - ref.total("loss")
  return update, loss


def _data_independent(dist, ref, other, trainable, tol=0.05):
  """The loss offset when dist - ref is the same on `other`'s data, else None.

  Returns 0.0 when the step returns no loss, or the same loss on both sides.
  """
  other_dist, other_ref = other
  update, loss = _offset(dist, ref, trainable)
  other_update, other_loss = _offset(other_dist, other_ref, trainable)
  # The other data must matter to the step, or anything looks constant.
  data_moves = Diff().add(_flat(other_ref.deltas, trainable),
                           _flat(ref.deltas, trainable)).rel_l2 > 2 * tol
  same_update = Diff().add(other_update, update).rel_l2 <= tol
  if not (data_moves and same_update and np.any(update)):
    return None
  if loss is None or other_loss is None:
    return 0.0
  if abs(other_loss - loss) > tol * abs(loss) + 1e-6:
    return None
  return loss


def _near(value, target, tol=0.05):
  return value is not None and abs(value - target) <= tol * abs(target)


def _penalty_finding(offset, n):
  """The cause of a difference independent of the data (loss `offset`)."""
  same = ("the update differs from one device by the same amount on other "
          "data: the extra term is independent of the data")
  if offset < 0:
    return Finding(
        "data_independent_term",
        f"{same}, and the loss is {-offset:.4g} lower on {n} replicas: a "
        "penalty/regulariser counts less than on one device (divided by the "
        "replica count twice?); add it once, scaled by "
        "tf.nn.scale_regularization_loss")
  amount = (f", and the loss is {offset:.4g} higher on {n} replicas on any "
            f"data, ({n} - 1) x {offset / (n - 1):.4g} (the penalty on one "
            "device)" if offset > 0 and n > 1 else "")
  return Finding(
      "unscaled_penalty",
      f"{same}{amount}: a penalty/regulariser added on every replica without "
      f"tf.nn.scale_regularization_loss counts {n} times; add "
      "tf.nn.scale_regularization_loss(penalty), or use a layer regulariser "
      "(model.losses), which the built-in step scales")


def _full(reg_grads, outcome):
  """Regularisation gradients indexed like `outcome.names` (all variables)."""
  full, it = [], iter(reg_grads)
  for trainable in outcome.trainable:
    full.append(next(it, None) if trainable else None)
  return full
