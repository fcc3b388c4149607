"""What `time_to_accuracy.py` reads from a finished run and reports.

A run's figures come from its log (`time_to_target_seconds`, the training
set's size), its `model_info.json` (the global batch) and its `eval/` event
files (the accuracy, `elapsed_seconds` and `time_to_target_seconds` of every
evaluation, with the wall time each summary was written at).
"""

import glob
import json
import math
import os
import re
import statistics

from scripts.curves import draw


def _eval_events(model_dir):
  """{tag: {step: (value, wall_time)}} of the scalars in `model_dir/eval`."""
  from scripts import cli  # pylint: disable=g-import-not-at-top
  cli.import_tensorflow_quietly()
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tags = {}
  for path in sorted(glob.glob(os.path.join(model_dir, "eval",
                                            "events.out.tfevents.*"))):
    for record in tf.data.TFRecordDataset(path):
      event = tf.compat.v1.Event.FromString(record.numpy())
      for value in event.summary.value:
        array = tf.make_ndarray(value.tensor)
        if array.dtype != object:
          tags.setdefault(value.tag, {})[event.step] = (float(array),
                                                        event.wall_time)
  return tags


def read_run(run, target):
  """The figures of a finished `time_to_accuracy.Run` as a JSON-able dict."""
  with open(run.log) as f:
    log = f.read()
  with open(os.path.join(run.model_dir, "model_info.json")) as f:
    batch = json.load(f)["global_batch_size"]
  sizes = re.search(r"dataset=\S+ train=(\d+) test=(\d+)", log)
  steps_per_epoch = int(sizes.group(1)) // batch if sizes else None
  events = _eval_events(run.model_dir)
  accuracy = events.get("accuracy", events.get("pixel_accuracy", {}))
  elapsed = events.get("elapsed_seconds", {})
  evaluations = [dict(
      step=step, epoch=step / steps_per_epoch if steps_per_epoch else None,
      elapsed_seconds=elapsed[step][0] if step in elapsed else None,
      accuracy=value) for step, (value, _) in sorted(accuracy.items())]
  recorded = events.get("time_to_target_seconds", {})
  logged = re.findall(r"time_to_target_seconds=([\d.]+)", log)
  time_to_target = (min(v for v, _ in recorded.values()) if recorded
                    else float(logged[-1]) if logged else None)
  best = max(evaluations, key=lambda e: e["accuracy"], default=None)
  # The compute dtype `--mixed_precision=auto` chose: a time means little
  # without it (bfloat16 on CPUs with AVX512_BF16, else float32).
  chosen = re.search(r"mixed_precision=auto: (\w+)", log)
  # Else as given; train.py's default is float32.
  precision = (chosen.group(1) if chosen else
               flag_value(run.command, "mixed_precision") or "float32")
  last = evaluations[-1] if evaluations else None
  return dict(
      name=run.name, seed=run.seed, command=run.command[1:], target=target,
      reached=time_to_target is not None, time_to_target_seconds=time_to_target,
      launch_to_target_seconds=(min(w for _, w in recorded.values())
                                - run.launch if recorded else None),
      wall_seconds=run.wall, best_accuracy=best and best["accuracy"],
      best_epoch=best and best["epoch"], final_step=last and last["step"],
      epochs_run=last and last["epoch"], steps_per_epoch=steps_per_epoch,
      global_batch_size=batch, model_dir=run.model_dir, log=run.log,
      matmul_peak_gflops=getattr(run, "peak_gflops", None),
      precision=precision, evaluations=evaluations)


def flag_value(args, name):
  """The value train.py takes for `--name=...` from `args` (the last one;
  each `--flagfile=F` read in its place), or None if none sets it."""
  value = None
  for arg in args:
    if arg.startswith("--flagfile="):
      with open(arg.split("=", 1)[1]) as f:
        in_file = flag_value([l.strip() for l in f
                              if l.strip().startswith("--")], name)
      value = value if in_file is None else in_file
      continue
    match = re.fullmatch(rf"--{name}=(\S+)", arg)
    if match:
      value = match.group(1)
  return value


def _seconds(value):
  return f"{value:.1f} s" if value is not None else "-"


def _percent(value):
  return f"{100 * value:.2f} %" if value is not None else "-"


def _gflops(value):
  return f"{value:.0f}" if value is not None else "-"


def _epochs(value):
  return f"{value:.2f}" if value is not None else "-"


def _median_time(figures):
  """Median time to target, a miss counting as infinitely slow (None when
  half or more missed)."""
  median = statistics.median(
      f["time_to_target_seconds"] if f["reached"] else math.inf
      for f in figures)
  return None if math.isinf(median) else median


def _table(figures):
  print(f"\n{'run':<22}{'reached':>8}{'time_to_target':>16}"
        f"{'launch':>10}{'wall':>10}{'best accuracy (epoch)':>24}"
        f"{'epochs':>8}{'peak GFLOP/s':>14}{'dtype':>10}")
  for f in figures:
    label = (f"seed {f['seed']}" if f["name"] == "recipe"
             else f"{f['name']} seed {f['seed']}")
    best = f"{_percent(f['best_accuracy'])} ({_epochs(f['best_epoch'])})"
    print(f"{label:<22}{'yes' if f['reached'] else 'no':>8}"
          f"{_seconds(f['time_to_target_seconds']):>16}"
          f"{_seconds(f['launch_to_target_seconds']):>10}"
          f"{_seconds(f['wall_seconds']):>10}{best:>24}"
          f"{_epochs(f['epochs_run']):>8}"
          f"{_gflops(f.get('matmul_peak_gflops')):>14}"
          f"{f.get('precision') or '-':>10}")


def _draw_curves(figures, results_dir, prefix, target):
  """`prefix`_seconds.png and `prefix`_epochs.png of one run's curve."""
  paths = []
  for axis, key in (("seconds", "elapsed_seconds"), ("epochs", "epoch")):
    curve = {e[key]: e["accuracy"] for e in figures["evaluations"]
             if e[key] is not None}
    if not curve:
      continue
    path = os.path.join(results_dir, f"{prefix}_{axis}.png")
    # The target first: the palette's first colour, not the test curve's.
    draw({"target": {0: target, max(curve): target}, "test": curve}, path,
         f"test accuracy: {figures['name']} seed {figures['seed']}",
         x_label=axis)
    paths.append(path)
  return paths


def report(runs, target, recipe, results_dir, goal, milestone):
  """Prints the tables and writes the JSON files and PNGs."""
  stem = os.path.splitext(os.path.basename(recipe))[0]
  recipe_runs = [r.figures for r in runs if r.name == "recipe"]
  variants = [r.figures for r in runs if r.name != "recipe"]
  print(f"\ntime to {_percent(target)} test accuracy: {recipe} "
        f"({len(recipe_runs)} seeds)")
  _table(recipe_runs)
  median = _median_time(recipe_runs)
  reached = sum(f["reached"] for f in recipe_runs)
  median_best = statistics.median(f["best_accuracy"] or 0
                                  for f in recipe_runs)
  if median is not None:
    print(f"\nmedian time to target: {median:.1f} s ({reached} of "
          f"{len(recipe_runs)} seeds reached {_percent(target)})")
  else:
    print(f"\nmedian time to target: not reached ({reached} of "
          f"{len(recipe_runs)} seeds reached {_percent(target)}); median "
          f"best accuracy {_percent(median_best)}")
  verdicts = {}
  for name, limit in (("goal", goal), ("milestone", milestone)):
    verdicts[name] = median is not None and median <= limit
    print(f"{name + ':':<11}median time to target <= {limit:g} s: "
          f"{'met' if verdicts[name] else 'not met'}")
  ablation = _ablation(recipe_runs[0], variants) if variants else []
  for f in recipe_runs + variants:
    f["curves"] = _draw_curves(f, results_dir, _prefix(stem, f), target)
    with open(os.path.join(results_dir, f"{_prefix(stem, f)}.json"),
              "w") as out:
      json.dump(f, out, indent=1)
  summary = dict(recipe=recipe, target=target, seeds=[f["seed"] for f in
                                                      recipe_runs],
                 median_time_to_target_seconds=median, seeds_reached=reached,
                 median_best_accuracy=median_best, goal_seconds=goal,
                 milestone_seconds=milestone, goal_met=verdicts["goal"],
                 milestone_met=verdicts["milestone"],
                 runs=[{k: v for k, v in f.items() if k != "evaluations"}
                       for f in recipe_runs], ablation=ablation)
  path = os.path.join(results_dir, f"{stem}_summary.json")
  with open(path, "w") as out:
    json.dump(summary, out, indent=1)
  print(f"\nwrote {path} and each run's JSON and PNGs in {results_dir}")
  return summary


def _prefix(stem, figures):
  if figures["name"] == "recipe":
    return f"{stem}_seed{figures['seed']}"
  return f"{stem}_{figures['name']}_seed{figures['seed']}"


def _ablation(full, variants):
  """Prints the ablation table; returns its rows. Delta: seconds to target
  when both runs reached it, else best accuracy in points."""
  print(f"\nablation (seed {full['seed']}; delta against the full recipe)")
  print(f"{'variant':<22}{'flags':<36}{'time_to_target':>16}"
        f"{'best accuracy':>15}{'delta':>12}")
  rows = []
  for f in [full] + variants:
    flags = " ".join(f["command"][len(full["command"]):]) or "(recipe)"
    if f is full:
      delta = None
    elif f["reached"] and full["reached"]:
      delta = dict(seconds=f["time_to_target_seconds"]
                   - full["time_to_target_seconds"])
    else:
      delta = dict(accuracy_points=100 * ((f["best_accuracy"] or 0)
                                          - (full["best_accuracy"] or 0)))
    text = ("-" if delta is None else f"{delta['seconds']:+.1f} s"
            if "seconds" in delta else f"{delta['accuracy_points']:+.2f} pt")
    name = "full recipe" if f is full else f["name"]
    print(f"{name:<22}{flags:<36}"
          f"{_seconds(f['time_to_target_seconds']):>16}"
          f"{_percent(f['best_accuracy']):>15}{text:>12}")
    rows.append(dict(variant=name, flags=flags,
                     time_to_target_seconds=f["time_to_target_seconds"],
                     best_accuracy=f["best_accuracy"], delta=delta))
  return rows
