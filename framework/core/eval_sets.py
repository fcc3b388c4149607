"""Named eval sets: the run's own (`eval/`) and more (`eval_<name>/`).

    Controller(..., eval_inputs={"eval": val_fn, "test": test_fn})

Each evaluation evaluates every set, in order, at the same step: the
default set `eval` (what `eval_input=` names) writes `model_dir/eval/`,
another set `name` writes `model_dir/eval_<name>/`; each is exact under any
replica count (a plain dataset's last batch is padded and masked,
`framework.data.inputs.pad_batches`). The eval actions get the primary
set's results (`eval`, else the first); the results of every set are in
`controller.eval_results[split]`, which `stop_when`, `stop_at_accuracy`
and `best_metric` read for a split such as `eval_test`.

`LoopConfig.eval_steps=N` evaluates the first N global batches of each set
only (Keras `validation_steps`): the log line says so and each set writes
the scalar `eval_steps`. It applies to an eval input that returns a
`tf.data.Dataset`, or a `Distributed` that says it is already limited;
another distributed dataset cannot be cut, which is a ConfigError.
"""

import dataclasses
import re
import time
from typing import Any, Callable, Mapping, Optional

from absl import logging
import tensorflow as tf

from framework.errors import ConfigError

DEFAULT = "eval"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def split_of(name: str) -> str:
  """The summary folder (split) of eval set `name`: eval, eval_<name>."""
  return DEFAULT if name == DEFAULT else f"{DEFAULT}_{name}"


def check_name(name: Any, what: str = "eval_inputs") -> str:
  """`name` if it can name an eval set's folder, else ConfigError."""
  if not isinstance(name, str) or not _NAME.fullmatch(name) or (
      name == "standalone"):
    raise ConfigError(
        f"{what}: eval set name {name!r} must be letters, digits, _ and - "
        "(it names the folder eval_<name>; 'standalone' is evaluate.py's)")
  return name


@dataclasses.dataclass(frozen=True)
class Distributed:
  """An eval input's distributed dataset that already holds at most `steps`
  global batches (None: all of them): `eval_steps` then applies as is."""
  dataset: Any
  steps: Optional[int] = None


def collect(eval_input: Optional[Callable[[], Any]],
            eval_inputs: Optional[Mapping[str, Callable[[], Any]]]
            ) -> dict[str, Callable[[], Any]]:
  """{split: input function}, the default set first; ConfigError on a bad
  or repeated name."""
  sets = {}
  if eval_input is not None:
    sets[DEFAULT] = eval_input
  for name, fn in (eval_inputs or {}).items():
    check_name(name)
    if split_of(name) in sets:
      raise ConfigError(f"eval_inputs[{name!r}]: the default eval set is "
                        "given twice (eval_input= and eval_inputs['eval'])")
    if not callable(fn):
      raise ConfigError(f"eval_inputs[{name!r}]={fn!r} must be a function "
                        "() -> dataset")
    sets[split_of(name)] = fn
  if DEFAULT in sets:
    sets = {DEFAULT: sets.pop(DEFAULT), **sets}
  return sets


def results_of(controller: Any, split: str,
               results: Mapping[str, float]) -> Mapping[str, float]:
  """The latest results of eval split `split` (`eval`: `results`, what the
  eval actions get, where the run has no other); ConfigError if the run has
  no such set."""
  found = getattr(controller, "eval_results", None) or {DEFAULT: results}
  if split not in found:
    raise ConfigError(
        f"{split}/...: the run has no eval set named "
        f"{split[len(DEFAULT) + 1:] or DEFAULT!r} (its eval splits: "
        f"{', '.join(sorted(found))})")
  return found[split]


def _prepare(controller, split, data, steps):
  """`data` from an eval input, padded, cut to `steps` and distributed."""
  if isinstance(data, Distributed):
    if steps is not None and (data.steps is None or data.steps > steps):
      raise ConfigError(f"eval_steps={steps}: the {split} input says it "
                        f"holds {data.steps or 'all'} batches")
    return data.dataset
  if isinstance(data, tf.data.Dataset):
    data = controller.batching.pad_eval(data)
    if steps is not None:
      data = data.take(steps)
    return controller.batching.distribute(data)
  if steps is not None:
    raise ConfigError(
        f"eval_steps={steps}: the {split} input returned an already "
        f"distributed {type(data).__name__}, which cannot be cut; return a "
        "tf.data.Dataset (the framework pads and distributes it) or "
        "framework.core.eval_sets.Distributed(dataset, steps)")
  return data


def evaluate_one(controller: Any, split: str, fn: Callable[[], Any],
                 step: int) -> dict:
  """Evaluates one set at `step`; writes its summaries and log line."""
  steps = controller.config.eval_steps
  data = _prepare(controller, split, fn(), steps)
  writer = controller.writer(split)
  with writer.as_default(step), tf.summary.record_if(True):
    results = dict(controller.evaluator.evaluate(data))
  scalars = {k: v for k, v in results.items() if k != "examples"}
  if controller.start_time is not None:
    # The wall-clock position of each evaluation on the run's time axis
    # (the origin of time_to_target): accuracy against seconds.
    scalars["elapsed_seconds"] = time.time() - controller.start_time
  if steps is not None:
    scalars["eval_steps"] = float(steps)
  writer.scalars(step, scalars)
  logging.info("%-5s step %d%s: %s", split, step,
               f" (eval_steps={steps}: the first {steps} global batches only)"
               if steps is not None else "", ", ".join(
                   f"{k}={v:.4f}" if k != "examples" else f"{k}={int(v)}"
                   for k, v in sorted(results.items())))
  return results
