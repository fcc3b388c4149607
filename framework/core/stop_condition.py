"""Early-stopping conditions: `SPLIT/METRIC OP VALUE` (TensorFlow-free, so
that `LoopConfig` checks `stop_when` before TensorFlow loads)."""

import dataclasses
import math
import operator
import re
from typing import Mapping, Optional

from framework.errors import ConfigError

_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt,
        ">=": operator.ge}
# An eval set's split: eval (the run's own) or eval_<name> (`eval_sets`).
_SPLIT = r"(train|eval(?:_[A-Za-z0-9][A-Za-z0-9_-]*)?)"
_CONDITION = re.compile(
    r"^\s*" + _SPLIT + r"/(\S+?)\s*(<=|>=|<|>)\s*([-+0-9.eEinfINFnaN]+)\s*$")
_METRIC = re.compile(r"^" + _SPLIT.replace("train|", "") + r"/([^\s/]+)$")


def parse_metric(text: str, name: str = "best_metric") -> tuple[str, str]:
  """`eval/accuracy` or `eval_<set>/<metric>` as (split, metric);
  ConfigError naming `name` if it is neither."""
  match = _METRIC.match(text) if isinstance(text, str) else None
  if match is None:
    raise ConfigError(
        f"{name}={text!r} must be SPLIT/METRIC with SPLIT eval (the run's "
        "own eval set) or eval_<name> (an eval set), e.g. eval/accuracy, "
        "eval/loss, eval_test/accuracy")
  return match.group(1), match.group(2)


@dataclasses.dataclass(frozen=True)
class StopCondition:
  """`split/metric OP value`, e.g. `eval/loss<0.1`, `train/mae<=0.05`.

  Attributes:
    split: "train" (checked after every loop), "eval" or "eval_<name>"
      (an eval set: after every evaluation).
    metric: a name the trainer returns (or an evaluator's alias of it,
      `metric_aliases`: e.g. the name a task reports accuracy under).
    op: one of <, <=, >, >=.
    value: the threshold.
  """
  split: str
  metric: str
  op: str
  value: float

  @classmethod
  def parse(cls, text: str, name: str = "stop_when") -> "StopCondition":
    """`text` as a condition; ConfigError naming `name` if it is not one."""
    match = _CONDITION.match(text) if isinstance(text, str) else None
    value = None
    if match:
      try:
        value = float(match.group(4))
      except ValueError:
        pass
    if value is None or not math.isfinite(value):
      raise ConfigError(
          f"{name}={text!r} must be SPLIT/METRIC OP VALUE with SPLIT train, "
          "eval or eval_<set>, OP one of < <= > >= and a finite VALUE (e.g. "
          "eval/loss<0.1, eval/accuracy>=0.9)")
    return cls(match.group(1), match.group(2), match.group(3), value)

  def __str__(self):
    return f"{self.split}/{self.metric}{self.op}{self.value:g}"

  def metric_value(self, outputs: Mapping[str, float],
                   aliases: Optional[Mapping[str, str]] = None) -> float:
    """The watched value in `outputs` (under `metric`, else its name in
    `aliases`); ConfigError if there is none."""
    for name in (self.metric, (aliases or {}).get(self.metric)):
      if name in outputs:
        return float(outputs[name])
    raise ConfigError(
        f"stop_when={self}: the {self.split} outputs have no "
        f"{self.metric!r} (only {', '.join(sorted(outputs))})")

  def met(self, outputs: Mapping[str, float],
          aliases: Optional[Mapping[str, str]] = None) -> bool:
    return _OPS[self.op](self.metric_value(outputs, aliases), self.value)
