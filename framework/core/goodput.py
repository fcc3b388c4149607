"""Goodput: the share of a run's wall time spent on steps that count.

After MaxText's goodput accounting (ml-goodput-measurement): a run's wall
time, from its first launch's process start to its latest record, summed
over relaunches, is split into

    productive     the time of training steps whose update the run keeps
    startup        the launch's start (the Controller's `start_time`) to
                   its first loop: data, model, the checkpoint restore
    compilation    the first loop's time beyond its steps' steady time
                   (tracing, XLA)
    checkpoint     checkpoint saves
    evaluation     evaluations
    restart        from a launch's last record to the next launch's start
                   (the crash, the relaunch)
    lost_steps     steps trained after the last checkpoint and trained
                   again after a relaunch (`restored`)
    <reason>       steps whose update was dropped (`lost_steps(n, reason)`:
                   `skipped`, a NaN or float16-overflow skip; a spike
                   policy's `spike_skipped`, `rolled_back`)
    other          the rest: summaries, logging, the loop's own Python

The parts add up to the wall time. The chief keeps the account in
`model_dir/goodput.json` (rewritten atomically after each loop, so a
relaunch knows what the killed launch did) and reports it at the end of
`Controller.run` in the log and as `train/goodput/*` scalars (TensorBoard,
metrics.jsonl). Steps trained but not yet covered by a checkpoint stay
`pending` in the file: a save makes them productive, a relaunch that
restores an earlier step makes them lost.
"""

import json
import math
import os
import time
from typing import Optional

from absl import logging

from framework.core.checkpoints import run_files
from framework.errors import ModelDirError

GOODPUT_FILE = "goodput.json"
# The timed parts besides productive steps, in report order.
PARTS = ("startup", "compilation", "checkpoint", "evaluation", "restart",
         "lost_steps")
# How far a read account's parts may exceed its wall time (rounding, the
# clock's steps), and its last record may lie after this launch's start
# (another host's clock after a relaunch elsewhere), in seconds.
_SLACK, _SLACK_SHARE = 1.0, 0.01
_CLOCK_SKEW = 3600.0


class Goodput:
  """A run's goodput account (see the module docstring).

  Args:
    model_dir: where `goodput.json` is kept.
    enabled: False on non-chief tasks: nothing is read or written.
    start_time: this launch's start (default: now), e.g. the
      Controller's `start_time`.
  """

  def __init__(self, model_dir: str, *, enabled: bool = True,
               start_time: Optional[float] = None):
    self.path = os.path.join(model_dir, GOODPUT_FILE)
    self.enabled = enabled
    self.launch_start = time.time() if start_time is None else start_time
    self.seconds = {"productive": 0.0, **{p: 0.0 for p in PARTS}}
    self.steps = {}  # {reason: steps lost}
    self.pending = []  # [[first, last, seconds]] not yet checkpointed
    self.launches = 1
    self.first_start = self.launch_start
    self._steady = None  # this launch's seconds per step after tracing
    self._first_entry = None  # this launch's first loop [first, last, s]
    self._per_step = None  # the latest loop's seconds per step
    self._trained = False  # whether this launch's first loop started
    self._unwritable = False  # a write failed (warned once)
    self._load()

  def _load(self):
    if not self.enabled:
      return
    try:
      record = run_files.read_json(self.path)
      if record is None:
        return
      seconds = {k: float(v) for k, v in record["seconds"].items()}
      steps = {k: int(v) for k, v in record["lost_step_counts"].items()}
      pending = [[int(a), int(b), float(s)] for a, b, s in record["pending"]]
      launches, first = int(record["launches"]), float(record["first_start"])
      last = float(record["last_time"])
      numbers = [*seconds.values(), *steps.values(), first, last,
                 *(x for entry in pending for x in entry)]
      if not (all(math.isfinite(x) and x >= 0 for x in numbers)
              and launches >= 1 and first <= last
              and all(a <= b for a, b, _ in pending)):
        # An edited account would report nonsense (nan%, -2 launches).
        raise ValueError("its numbers are not finite non-negative seconds "
                         "and counts, launches >= 1, first_start <= "
                         "last_time")
      timed = sum(seconds.values()) + sum(s for _, _, s in pending)
      wall = last - first
      if timed > wall + _SLACK + _SLACK_SHARE * wall:
        # Parts beyond the recorded wall time (1e300 s of productive)
        # would report a goodput of 100% of nonsense.
        raise ValueError(f"its parts add up to {timed:.6g} s, more than "
                         f"its wall time {wall:.6g} s")
      if last > self.launch_start + _CLOCK_SKEW:
        raise ValueError(f"its last_time {last:.6g} is after this launch's "
                         f"start {self.launch_start:.6g}")
      if set(seconds) & {"wall", "other"}:
        # Names the account computes itself; read back, they would
        # replace the computed wall time.
        raise ValueError("its seconds name 'wall' or 'other'")
    except Exception as e:  # pylint: disable=broad-except
      # An account that does not parse is no reason to stop training.
      logging.warning("%s is not a goodput account (%s); counting from this "
                      "launch", self.path, str(e).splitlines()[0][:200]
                      if str(e) else type(e).__name__)
      return
    self.seconds.update(seconds)
    self.steps, self.pending = steps, pending
    self.launches, self.first_start = launches + 1, first
    # The killed (or finished) launch's unrecorded end and this start.
    self.seconds["restart"] += max(self.launch_start - last, 0.0)

  def restored(self, step: int, reason: str = "lost_steps") -> None:
    """The run went back to `step` (a relaunch's restore, a rollback): the
    pending steps past it are trained again, their time lost to `reason`;
    those up to it count."""
    for first, last, seconds in self.pending:
      kept = min(max(step - first + 1, 0), last - first + 1)
      share = seconds * kept / (last - first + 1)
      self.seconds["productive"] += share
      self._lose(last - first + 1 - kept, reason, seconds - share)
    self.pending = []

  def saved(self, step: int) -> None:
    """A checkpoint at `step`: the pending steps up to it count; those
    after it (trained while a background write was in flight) stay
    pending."""
    later = [entry for entry in self.pending if entry[0] > step]
    self.pending = [entry for entry in self.pending if entry[0] <= step]
    self.restored(step)
    self.pending = later

  def loop(self, first: int, last: int, elapsed: float) -> None:
    """Steps `first..last` trained in `elapsed` s. A launch's first loop
    (tracing, compilation) counts at its second loop's pace per step, the
    rest of it as compilation."""
    entry = [first, last, elapsed]
    if self._first_entry is None:
      self._first_entry = entry
    elif self._steady is None:
      self._steady = elapsed / (last - first + 1)
      a, b, seconds = self._first_entry
      compiling = max(seconds - self._steady * (b - a + 1), 0.0)
      self.seconds["compilation"] += compiling
      self._take(self._first_entry, compiling)
    self.pending.append(entry)
    self._per_step = elapsed / (last - first + 1)

  def _take(self, entry, seconds):
    """`seconds` out of `entry`'s time: pending still, or productive."""
    if any(entry is p for p in self.pending):
      entry[2] -= seconds
    else:
      self.seconds["productive"] -= seconds

  def lost_steps(self, n: int, reason: str) -> None:
    """`n` of the latest loop's steps trained for nothing (`reason`:
    `skipped`, `spike_skipped`, `rolled_back`, ...): their time leaves
    productive."""
    if n <= 0 or self._per_step is None:
      return
    moved = n * self._per_step
    if self.pending:
      moved = min(moved, self.pending[-1][2])
      self.pending[-1][2] -= moved
    else:
      self.seconds["productive"] -= moved
    self._lose(n, reason, moved)

  def _lose(self, n, reason, seconds):
    if n <= 0:
      return
    self.seconds[reason] = self.seconds.get(reason, 0.0) + seconds
    self.steps[reason] = self.steps.get(reason, 0) + n

  def training(self, now: float) -> None:
    """A loop starts at `now`; the launch's first ends its start-up."""
    if not self._trained:
      self._trained = True
      self.seconds["startup"] += max(now - self.launch_start, 0.0)

  def add(self, part: str, seconds: float) -> None:
    """`seconds` of `part` (`startup`, `checkpoint`, `evaluation`)."""
    self.seconds[part] = self.seconds.get(part, 0.0) + seconds

  def account(self, now: Optional[float] = None) -> dict:
    """{part: seconds} adding up to the wall time, with `other` the rest;
    pending (and a lone first loop's) steps as productive."""
    now = time.time() if now is None else now
    parts = dict(self.seconds)
    parts["productive"] += sum(s for _, _, s in self.pending)
    wall = now - self.first_start
    parts["other"] = max(wall - sum(parts.values()), 0.0)
    return {"wall": max(wall, sum(parts.values())), **parts}

  def write(self, now: Optional[float] = None) -> None:
    """Rewrites `goodput.json` (the chief's)."""
    if not self.enabled:
      return
    now = time.time() if now is None else now
    pending = [list(p) for p in self.pending]
    record = {"launches": self.launches, "first_start": self.first_start,
              "last_time": now, "seconds": self.seconds,
              "lost_step_counts": self.steps, "pending": pending,
              "account": self.account(now)}
    try:
      run_files.write_text(self.path, json.dumps(record, indent=1) + "\n")
    except ModelDirError as e:
      # The account is no reason to stop training (a full disk is the
      # checkpoint's to report); said once.
      if not self._unwritable:
        logging.warning("goodput account not written: %s", e)
      self._unwritable = True

  def report(self, step: int, writer) -> dict:
    """Logs the account in one line and writes `goodput/*` to `train/`
    at `step`; returns it."""
    account = self.account()
    if not self.enabled:
      return account
    self.write()
    wall = account["wall"]
    fraction = account["productive"] / wall if wall > 0 else 0.0
    rest = [(k, v) for k, v in account.items()
            if k not in ("wall", "productive")]
    logging.info(
        "goodput %.1f%% of %.1f s over %d launch(es): productive %.1f s; %s",
        100 * fraction, wall, self.launches, account["productive"],
        ", ".join(f"{k} {v:.1f} s" + (f" ({self.steps[k]} steps)"
                                      if self.steps.get(k) else "")
                  for k, v in rest))
    writer("train").scalars(step, {
        "goodput/fraction": fraction, "goodput/wall_seconds": wall,
        "goodput/launches": float(self.launches),
        **{f"goodput/{k}_seconds": v for k, v in account.items()
           if k != "wall"},
        **{f"goodput/{k}_steps": float(n) for k, n in self.steps.items()}})
    return account
