"""Time to accuracy (issue 14): a recipe trained once per seed, timed.

    python scripts/benchmarks/time_to_accuracy.py \
        --data_dir=../shared/data/cifar10/cifar-10-batches-py \
        --work_dir=/tmp/time_to_accuracy --overwrite --ablate=builtin

Runs `scripts/train.py --flagfile=<--recipe> --seed=S --model_dir=<work_dir>/
seed_S [--extra ...]` for each of `--seeds`, one after the other, each in a
fresh process, and reads from each run: `time_to_target_seconds` (the run's
own figure: from the start of `experiment.run`, data loading, tracing, every
step and evaluation included, to the end of the evaluation that reached
`--stop_at_accuracy`), the test accuracy at every evaluation with its step
and `elapsed_seconds` (same origin), and the best accuracy. It measures too:
`wall`, the process from launch to exit (imports and the final export
included), and `launch`, from launch to the target evaluation's summary.

Prints a table per seed and the median time to target over the seeds (a
seed that missed the target counts as infinitely slow: "not reached" when
half or more missed, with the median best accuracy), and whether the goal
(`--goal_seconds`) and the milestone (`--milestone_seconds`) are met. Writes
to `--results_dir`, per run, `<recipe>_seed<S>.json` (every evaluation) and
two PNGs (test accuracy against seconds and against epochs), and
`<recipe>_summary.json`.

`--ablate`: variants of the recipe, each one set of extra flags, trained
with the first seed; the ablation table gives each one's time to target (or
best accuracy) and the difference to the full recipe's run of that seed.
A value is a comma-separated list of built-in variants (`builtin`: all of
them; see ABLATIONS), or one `NAME:FLAGS` variant, FLAGS separated by
spaces: `--ablate=no_ema,no_tta --ablate="sgd_plain:--nonesterov
--lr_schedule=constant"`.
"""

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from scripts import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup(import_tensorflow=False)  # only to read the event files

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

from scripts.benchmarks import matmul_peak  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_string("recipe", os.path.join(
    ROOT, "scripts", "configs", "cifar10_fast.cfg"), "Flag file of the "
    "recipe; it (or --extra) must set --stop_at_accuracy.")
flags.DEFINE_string("data_dir", None, "train.py's --data_dir (default: "
                    "train.py's).")
flags.DEFINE_list("seeds", ["0", "1", "2"], "One run per seed, in order.")
flags.DEFINE_multi_string("extra", [], "One more train.py flag for every "
                          "run, repeatable: --extra=--epochs=12 "
                          "--extra=--strategy=mirrored.")
flags.DEFINE_multi_string("ablate", [], "Variants of the recipe, run with "
                          "the first seed: built-in names separated by "
                          "commas (builtin: all), or NAME:FLAGS (train.py "
                          "flags separated by spaces); repeatable.")
flags.DEFINE_string("work_dir", "/tmp/time_to_accuracy", "Each run's "
                    "model_dir (seed_S, <variant>_seed_S) and log (.log).")
flags.DEFINE_bool("overwrite", False, "Delete the runs' model_dirs in "
                  "--work_dir first (otherwise they must not exist: a run "
                  "would resume from their checkpoints).")
flags.DEFINE_string("results_dir", os.path.join(
    ROOT, "docs", "results", "time_to_accuracy"), "The curves (PNG) and "
    "figures (JSON).")
flags.DEFINE_float("goal_seconds", 300, "The goal: median time to target.")
flags.DEFINE_bool("measure_peak", True, "Before each run, measure the "
                  "machine's float32 matmul GFLOP/s (about 10 s) and report "
                  "it with the run.")
flags.DEFINE_float("milestone_seconds", 600, "The first milestone.")

PROG = "time_to_accuracy.py"
# Each removes one feature of scripts/configs/cifar10_fast.cfg (or, for
# with_label_smoothing, puts back one it dropped).
ABLATIONS = {
    "no_ema": ("--ema_decay=0",),
    "no_tta": ("--eval_tta=none",),
    "with_label_smoothing": ("--label_smoothing=0.1",),
    "no_augment": ("--augment=none",),
    "no_nesterov": ("--nonesterov",),
    "float32": ("--mixed_precision=float32",),
    # off, not default: TensorFlow turns oneDNN on by itself on CPUs with
    # AVX512_VNNI/BF16, where default would change nothing.
    "no_onednn": ("--onednn=off",),
}
# Set by this script for every run.
_OWN_FLAGS = ("flagfile", "seed", "model_dir")


def _error(message):
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  return ConfigError(message)


def _seeds():
  try:
    seeds = [int(s) for s in FLAGS.seeds]
  except ValueError:
    raise _error(f"seeds={','.join(FLAGS.seeds)} must be integers separated "
                 "by commas") from None
  if not seeds or len(set(seeds)) != len(seeds):
    raise _error(f"seeds={','.join(FLAGS.seeds)} must be distinct integers "
                 "(at least one)")
  return seeds


def _check_flags(flag_list, what):
  for flag in flag_list:
    name = flag.lstrip("-").split("=")[0]
    if not flag.startswith("-") or not name:
      raise _error(f"{what}: {flag!r} is not a train.py flag (--name=value)")
    if name in _OWN_FLAGS:
      raise _error(f"{what}: {flag!r}: --{name} is set by {PROG} "
                   f"(--recipe, --seeds, --work_dir)")
  return tuple(flag_list)


def parse_ablations(values):
  """[(name, extra flags)] from the --ablate values (ConfigError if bad)."""
  variants = []
  for value in values:
    if ":" in value:
      name, _, spec = value.partition(":")
      flag_list = shlex.split(spec)
      if not flag_list:
        raise _error(f"ablate={value!r}: no flags after '{name}:'")
      entries = [(name, _check_flags(flag_list, f"ablate={value!r}"))]
    else:
      names = [n.strip() for n in value.split(",")]
      if names == ["builtin"]:
        names = list(ABLATIONS)
      unknown = [n for n in names if n not in ABLATIONS]
      if unknown:
        raise _error(f"ablate={value!r}: unknown variant {unknown[0]!r}; "
                     f"built-in: builtin, {', '.join(ABLATIONS)}; or "
                     "NAME:FLAGS")
      entries = [(n, ABLATIONS[n]) for n in names]
    for name, flag_list in entries:
      if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name == "seed":
        raise _error(f"ablate: variant name {name!r} must be letters, "
                     "digits, '_', '.' or '-' (and not 'seed')")
      if name in dict(variants):
        raise _error(f"ablate: variant {name!r} given twice")
      variants.append((name, flag_list))
  return variants


def recipe_target(recipe, extra):
  """The last --stop_at_accuracy of the recipe file and `extra`, or None."""
  from scripts.benchmarks import tta_report  # pylint: disable=g-import-not-at-top
  target = tta_report.flag_value([f"--flagfile={recipe}", *extra],
                                 "stop_at_accuracy")
  return None if target is None else float(target)


class Run:
  """One train.py process: its command, paths and (after `read`) figures."""

  def __init__(self, name, seed, extra):
    self.name, self.seed, self.extra = name, seed, extra
    label = f"seed_{seed}" if name == "recipe" else f"{name}_seed_{seed}"
    self.model_dir = os.path.join(FLAGS.work_dir, label)
    self.log = self.model_dir + ".log"
    stem = os.path.splitext(os.path.basename(FLAGS.recipe))[0]
    self.prefix = (f"{stem}_seed{seed}" if name == "recipe"
                   else f"{stem}_{name}_seed{seed}")
    self.command = [
        sys.executable, os.path.join(ROOT, "scripts", "train.py"),
        f"--flagfile={os.path.abspath(FLAGS.recipe)}", f"--seed={seed}",
        f"--model_dir={self.model_dir}",
        *([f"--data_dir={FLAGS.data_dir}"] if FLAGS.data_dir else []),
        *FLAGS.extra, *extra]
    self.figures = None
    self.peak_gflops = None

  def train(self):
    """Runs the process (its output to `self.log`); ConfigError on failure."""
    print(f"[{self.name} seed {self.seed}] {shlex.join(self.command[1:])}",
          flush=True)
    if FLAGS.measure_peak:
      self.peak_gflops = matmul_peak_gflops(FLAGS.peak_matmul_size)
      print(f"[{self.name} seed {self.seed}] float32 matmul peak before the "
            f"run: {self.peak_gflops:.1f} GFLOP/s", flush=True)
    launch, start = time.time(), time.monotonic()
    with open(self.log, "w") as log:
      proc = subprocess.Popen(self.command, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
      for line in proc.stdout:
        log.write(line)
        log.flush()  # to follow a run with tail -f
        if re.search(r"eval  step|target accuracy|: error: ", line):
          print(f"[{self.name} seed {self.seed}] {line.rstrip()}", flush=True)
      proc.wait()
    self.wall, self.launch = time.monotonic() - start, launch
    if proc.returncode:
      with open(self.log) as f:
        errors = [l.strip() for l in f if ": error: " in l] or ["no error "
                                                               "line"]
      raise _error(f"{self.name} seed {self.seed}: train.py exited "
                   f"{proc.returncode} ({errors[-1]}); log: {self.log}")


def matmul_peak_gflops(size):
  """This machine's float32 matmul rate now, in a process of its own: the
  same machine runs at different speeds on different days (shared hosts),
  so each run's seconds are reported with it."""
  proc = subprocess.run(
      [sys.executable, matmul_peak.__file__,
       f"--peak_matmul_size={size}"],
      capture_output=True, text=True, check=False)
  try:
    return float(proc.stdout.split()[-1])
  except (IndexError, ValueError):
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    raise _error(f"measuring the matmul peak failed (exit "
                 f"{proc.returncode}: {last}); --nomeasure_peak skips "
                 "it") from None


def main_run():
  seeds = _seeds()
  if not os.path.isfile(FLAGS.recipe):
    raise _error(f"recipe={FLAGS.recipe} is not a file")
  extra = _check_flags(FLAGS.extra, "extra")
  variants = parse_ablations(FLAGS.ablate)
  target = recipe_target(FLAGS.recipe, extra)
  if target is None:
    raise _error(f"recipe={FLAGS.recipe} sets no --stop_at_accuracy (nor "
                 "does --extra): no target to time")
  for name in ("goal_seconds", "milestone_seconds"):
    if not FLAGS[name].value > 0:
      raise _error(f"{name}={FLAGS[name].value} must be > 0")
  runs = [Run("recipe", s, ()) for s in seeds]
  runs += [Run(name, seeds[0], flag_list) for name, flag_list in variants]
  _prepare_dirs(runs)
  from scripts.benchmarks import tta_report  # pylint: disable=g-import-not-at-top
  for run in runs:
    run.train()
  for run in runs:
    run.figures = tta_report.read_run(run, target)
  tta_report.report(runs, target, FLAGS.recipe, FLAGS.results_dir,
                    FLAGS.goal_seconds, FLAGS.milestone_seconds)


def _prepare_dirs(runs):
  """Checks (or, with --overwrite, empties) every run's model_dir, before
  anything is written."""
  import shutil  # pylint: disable=g-import-not-at-top
  taken = [r.model_dir for r in runs if os.path.exists(r.model_dir)]
  if taken and not FLAGS.overwrite:
    raise _error(f"{taken[0]} exists (a run there would resume from its "
                 "checkpoints): choose another --work_dir or pass "
                 "--overwrite")
  for path in taken:
    shutil.rmtree(path)
  os.makedirs(FLAGS.work_dir, exist_ok=True)
  os.makedirs(FLAGS.results_dir, exist_ok=True)


main = cli.main_running(main_run)

if __name__ == "__main__":
  app.run(main)
