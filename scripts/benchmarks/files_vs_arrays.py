"""The same recipe from TFRecord files and from in-memory arrays: accuracy and speed.

    python scripts/make_tfrecords.py --dataset=cifar10 \
        --data_dir=../shared/data/cifar10/cifar-10-batches-py \
        --output_dir=/tmp/cifar10_tfrecords --num_shards=16
    python scripts/benchmarks/files_vs_arrays.py \
        --data_dir=../shared/data/cifar10/cifar-10-batches-py \
        --tfrecord_dir=/tmp/cifar10_tfrecords --work_dir=/tmp/files_vs_arrays

Trains `--flagfile` (default: the CIFAR-10 reference recipe) for `--epochs`
twice, one run after the other: `--dataset=cifar10` from the pickle files
(in-memory arrays) and `--dataset=tfrecord` from the converted files. Prints
the test accuracy at every evaluation of both runs and their difference,
the median training examples/s of each (the first loop, which traces, left
out) and their ratio, and draws both test curves in one PNG. `--measured`
skips training and reads the two runs already in `--work_dir`.

The files run uses `--file_shuffle=global` (default here): on one worker its
batches are the arrays' batches, so both runs should train identically (the
final weights' sha256 of both logs are compared). `--file_shuffle=shards`
(train.py's default, bounded memory) shuffles differently: the accuracies
then differ by the noise of another data order.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from scripts import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()
from scripts.curves import draw, read_scalars  # pylint: disable=g-import-not-at-top

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", None, "CIFAR-10 pickle directory.")
flags.DEFINE_string("tfrecord_dir", None, "The same data converted by "
                    "make_tfrecords.py.")
flags.DEFINE_string("work_dir", "/tmp/files_vs_arrays", "The two runs' "
                    "model_dirs (`arrays`, `files`) and logs go here.")
flags.DEFINE_string("recipe", os.path.join(
    ROOT, "scripts", "configs", "cifar10_reference.cfg"), "Flag file of the "
    "recipe.")
flags.DEFINE_integer("epochs", 10, "Epochs of each run.")
flags.DEFINE_enum("file_shuffle", "global", ["global", "shards"],
                  "The files run's --file_shuffle: global gives the arrays' "
                  "batches exactly; shards, another order.")
flags.DEFINE_list("extra", [], "More train.py flags for both runs, e.g. "
                  "--extra=--strategy=default.")
flags.DEFINE_bool("measured", False, "Only read the runs in --work_dir.")
flags.DEFINE_string("output", None, "PNG of both test curves (default: "
                    "work_dir/files_vs_arrays.png).")
flags.mark_flags_as_required(["data_dir", "tfrecord_dir"])

RUNS = (("arrays", "cifar10", "data_dir"), ("files", "tfrecord",
                                            "tfrecord_dir"))


def _train(name, dataset, data_dir):
  model_dir = os.path.join(FLAGS.work_dir, name)
  command = [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
             f"--flagfile={FLAGS.recipe}", f"--epochs={FLAGS.epochs}",
             f"--dataset={dataset}", f"--data_dir={data_dir}",
             f"--model_dir={model_dir}", *FLAGS.extra]
  if dataset != "cifar10":
    command.append(f"--file_shuffle={FLAGS.file_shuffle}")
  print(f"training {name}: {' '.join(command[1:])}", flush=True)
  with open(os.path.join(FLAGS.work_dir, f"{name}.log"), "w") as log:
    if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode:
      sys.exit(f"files_vs_arrays.py: error: the {name} run failed; see "
               f"{log.name}")


def _final_weights(name):
  with open(os.path.join(FLAGS.work_dir, f"{name}.log")) as log:
    found = re.findall(r"final weights sha256=(\w+)", log.read())
  return found[-1] if found else None


def _read(name):
  model_dir = os.path.join(FLAGS.work_dir, name)
  test, _ = read_scalars(os.path.join(model_dir, "eval"))
  train, _ = read_scalars(os.path.join(model_dir, "train"))
  rates = [v for _, v in train.get("examples_per_second", [])][1:]
  if not test.get("accuracy") or not rates:
    sys.exit(f"files_vs_arrays.py: error: {model_dir} has no eval accuracy "
             f"or examples_per_second events")
  return dict(test["accuracy"]), float(np.median(rates))


def main(argv):
  del argv
  os.makedirs(FLAGS.work_dir, exist_ok=True)
  if not FLAGS.measured:
    for name, dataset, dir_flag in RUNS:
      _train(name, dataset, FLAGS[dir_flag].value)
  (arrays, arrays_rate), (files, files_rate) = _read("arrays"), _read("files")
  print(f"{'step':>6}{'arrays':>10}{'files':>10}{'files-arrays':>14}")
  diffs = []
  for step in sorted(set(arrays) | set(files)):
    a, f = arrays.get(step), files.get(step)
    diff = (f - a) if a is not None and f is not None else None
    if diff is not None:
      diffs.append(diff)
    cells = [f"{100 * v:>9.2f}%" if v is not None else f"{'-':>10}"
             for v in (a, f)]
    print(f"{step:>6}" + "".join(cells) + (
        f"{100 * diff:>+13.2f}" if diff is not None else ""))
  print(f"max |files - arrays|: {100 * max(map(abs, diffs)):.2f} points over "
        f"{len(diffs)} evaluations; final {100 * diffs[-1]:+.2f}")
  print(f"examples/s: arrays {arrays_rate:,.0f}, files {files_rate:,.0f}, "
        f"files/arrays {files_rate / arrays_rate:.3f}")
  weights = _final_weights("arrays"), _final_weights("files")
  print(f"final weights sha256: arrays {weights[0]}, files {weights[1]}: "
        f"{'identical' if weights[0] == weights[1] else 'different'}")
  steps = sorted(set(arrays) | set(files))
  per_step = max(1, steps[0]) if steps else 1
  output = FLAGS.output or os.path.join(FLAGS.work_dir, "files_vs_arrays.png")
  draw({name: {step // per_step: v for step, v in curve.items()}
        for name, curve in (("arrays (test)", arrays),
                            ("files (test)", files))},
       output, "test accuracy per evaluation: TFRecord files vs arrays")
  print(f"wrote {output}")


if __name__ == "__main__":
  app.run(main)
