"""The distribution check's report: verdict, causes, warnings and table."""

import dataclasses

from framework.check import distribution_randomness
from framework.check.distribution_diagnosis import WARNING_CAUSES, Finding
from framework.errors import DistloopError

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
        f"the distribution's centre ({distribution_randomness.NORMAL:g} for "
        f"normal, {distribution_randomness.UNIFORM:g} for uniform [0, 1)) on "
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
