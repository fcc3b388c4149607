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
