"""When the loop's events fall: how many steps the next `train` call runs.

Each call runs up to the next event: a summary, log line, checkpoint or
evaluation interval (`LoopConfig.*_every`), a profiler window's boundary,
or `train_steps`, and at most `steps_per_loop` steps (an int, or Orbit's
function of the global step, e.g. `lambda step: 10 if step < 100 else
1000`; what it returns is checked each loop).
"""

from typing import Any, Sequence

from framework.errors import ConfigError


def due(every: int, step: int) -> bool:
  """Whether an interval of `every` steps (0: never) ends at `step`."""
  return bool(every) and step % every == 0


def steps_per_loop(config: Any, step: int) -> int:
  """`steps_per_loop`, or what it returns for `step` if it is callable."""
  every = config.steps_per_loop
  steps = every(step) if callable(every) else every
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ConfigError(f"steps_per_loop({step}) returned {steps!r}; it must "
                      "return an integer >= 1")
  return steps


def steps_to_next_event(config: Any, step: int,
                        boundaries: Sequence[int] = ()) -> int:
  """The steps from `step` to the next event (`boundaries`: the profiler
  window's)."""
  candidates = [steps_per_loop(config, step), config.train_steps - step]
  for every in (config.checkpoint_every, config.eval_every,
                config.summary_every, config.log_every):
    if every:
      candidates.append(every - step % every)
  candidates += [b - step for b in boundaries if b > step]
  return min(candidates)
