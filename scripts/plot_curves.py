"""Plots train/test accuracy per epoch from a run's TensorBoard event files.

    python scripts/plot_curves.py --model_dir=runs/cifar --output=curves.png

Reads `model_dir/train` and `model_dir/eval` (written by the Controller),
converts steps to epochs with the run's recorded `global_batch_size` and
`--train_examples`, prints a per-epoch table and draws a PNG with PIL only
(matplotlib is not a dependency).
"""

import json
import os
import re
import sys

try:  # Installed: the package distloop_cli.
  from . import cli  # pylint: disable=g-import-not-at-top
except ImportError:  # python scripts/<app>.py
  from distloop_cli import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()  # Before TensorFlow is imported.
try:
  from .curves import draw, per_epoch, read_scalars  # pylint: disable=g-import-not-at-top
except ImportError:
  from distloop_cli.curves import draw, per_epoch, read_scalars  # pylint: disable=g-import-not-at-top

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", None, "The run's model_dir.")
flags.DEFINE_string("output", None, "PNG path (default: "
                    "model_dir/accuracy.png).")
flags.DEFINE_integer("train_examples", 50000, "Training examples per epoch.")
flags.DEFINE_string("tag", "accuracy", "The scalar to plot.")
flags.DEFINE_string("output_json", None, "Also write the per-epoch values.")
flags.mark_flag_as_required("model_dir")

def main(argv):
  del argv
  train, texts = read_scalars(os.path.join(FLAGS.model_dir, "train"))
  test, _ = read_scalars(os.path.join(FLAGS.model_dir, "eval"))
  match = re.search(r"\| global_batch_size \| (\d+) \|",
                    texts.get("flags", ""))
  if not match:
    sys.exit(f"plot_curves.py: error: no recorded global_batch_size in "
             f"{FLAGS.model_dir}/train (not a distloop run?)")
  steps_per_epoch = FLAGS.train_examples // int(match.group(1))
  curves = {"train": per_epoch(train.get(FLAGS.tag, []), steps_per_epoch),
            "test": per_epoch(test.get(FLAGS.tag, []), steps_per_epoch)}
  print(f"{'epoch':>6}{'train':>10}{'test':>10}")
  for epoch in sorted(set(curves["train"]) | set(curves["test"])):
    row = [curves[k].get(epoch) for k in ("train", "test")]
    print(f"{epoch:>6}" + "".join(
        f"{100 * v:>9.2f}%" if v is not None else f"{'-':>10}" for v in row))
  output = FLAGS.output or os.path.join(FLAGS.model_dir, "accuracy.png")
  draw(curves, output, f"{FLAGS.tag}: {FLAGS.model_dir}")
  print(f"wrote {output}")
  if FLAGS.output_json:
    with open(FLAGS.output_json, "w") as f:
      json.dump(curves, f, indent=2)


if __name__ == "__main__":
  app.run(main)
