"""The comparison behind the distribution check, and the causes it names.

Given what one train step changed under the strategy (`dist`), on one device
(`ref`) and on one device with the batch reversed (`noise`: the same math,
another float summation order), `compare` returns the table rows and the
likely causes. The gradient pattern is read from the probe optimizer's
update (update = -applied gradient) split into a data part and a
regularisation part:

    applied ≈ a · data_gradient + b · regularisation_gradient

    a = N, b = 1          loss averaged over the per-replica batch
    a = N, b = N          gradients all-reduced twice (same loss)
    a = b = 1/N           MEAN all-reduce of shares
    a = 1, b = N          regularisation loss not scaled
    no fit, clip active   gradient clipped per replica

A difference that none of these explains is compared on other data
(`other`): when the update and the loss differ from one device by the same
amount whatever the data, the extra term does not depend on the data — a
penalty added in full on every replica, whose loss offset is (N - 1) x the
penalty.
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
# Causes that are warnings: the step is right, the check could not tell.
WARNING_CAUSES = ("rounding_noise",)


@dataclasses.dataclass(frozen=True)
class Finding:
  """A named cause (a failure) or a warning, with advice in words."""
  code: str
  message: str


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
  data_moves = _Diff().add(_flat(other_ref.deltas, trainable),
                           _flat(ref.deltas, trainable)).rel_l2 > 2 * tol
  same_update = _Diff().add(other_update, update).rel_l2 <= tol
  if not (data_moves and same_update and np.any(update)):
    return None
  if loss is None or other_loss is None:
    return 0.0
  if abs(other_loss - loss) > tol * abs(loss) + 1e-6:
    return None
  return loss


def _near(value, target, tol=0.05):
  return value is not None and abs(value - target) <= tol * abs(target)


def compare(dist, ref, noise, replicas, rtol, atol, reg_grads, clip_norm,
            probe, other=None):
  """(rows, causes): `dist` against `ref`, `noise` the rounding noise.

  `other`: (dist, ref) on other data, to tell a data-independent difference.
  """
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
  uncapped = min(max(rtol, NOISE_FACTOR * worst), NOISE_LIMIT)
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
  steps_taken = ref_steps = None
  for i, (name, d, r, e) in enumerate(zip(
      dist.opt_names, dist.opt_deltas, ref.opt_deltas, noise.opt_deltas)):
    leaf = kind = name.rsplit("/", 1)[-1]
    for prefix in slot_prefixes:  # "<variable path>_<slot>" -> "<slot>"
      if leaf.startswith(prefix):
        kind = leaf[len(prefix):]
        break
    if i == dist.opt_steps:
      steps_taken, ref_steps = float(np.max(d)), float(np.max(r))
    opt_groups.setdefault(kind, _Diff()).add(d, r)
    opt_noise.setdefault(kind, _Diff()).add(e, r)
  for kind, diff in opt_groups.items():
    rows.append(diff.row("optimizer", kind,
                         max(tol, tolerance_of(opt_noise[kind].rel_l2)), atol))

  # Metrics: the SUM of shares, as the trainer reports them.
  metric_bad = {}
  ref_metrics = {k: ref.total(k) for k in ref.metrics}
  for k, shares in dist.metrics.items():
    value = dist.total(k)
    expected = ref_metrics.get(k)
    if expected is None:
      nan = float("nan")
      rows.append(Row("metric", f"{k} (not in reference)", nan, nan, nan,
                      rtol, False))
      metric_bad[k] = (value, None, shares)
      continue
    noise_diff = _Diff().add(noise.total(k), expected)
    row = _Diff().add(value, expected).row(
        "metric", k, tolerance_of(noise_diff.rel_l2), atol)
    rows.append(row)
    if not row.ok:
      metric_bad[k] = (value, expected, shares)

  # --- Causes, from the pattern. ---
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
    elif other is not None and _data_independent(
        dist, ref, other, trainable) is not None:
      explained_loss = True
      causes.append(_penalty_finding(
          _data_independent(dist, ref, other, trainable), n))
    elif tol < uncapped and max(
        (r.rel_l2 for r in rows if r.section == "update" and not r.ok),
        default=0.0) <= uncapped:
      largest = max((r for r in rows if r.section == "update" and not r.ok),
                    key=lambda r: r.rel_l2)
      explained_loss = True
      causes.append(Finding(
          "rounding_noise",
          f"the updates differ by up to {largest.rel_l2:.3g} (relative L2, "
          f"{largest.name}), within {NOISE_FACTOR:g}x this model's float32 "
          f"rounding noise ({worst:.3g}, the same step on one device with the "
          "batch reordered) but above the check's "
          f"{MAX_TOLERANCE:g} cap: rounding amplified by the model (deep "
          "BatchNorm stacks do), not a distribution error of a known kind "
          "(those move an update by a factor); check at a smaller size to "
          "compare tighter"))
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
