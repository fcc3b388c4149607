"""Plots a run's train/test curve from its TensorBoard event files.

    python scripts/plot_curves.py --model_dir=runs/cifar --output=curves.png
    python scripts/plot_curves.py --model_dir=runs/gpt --tag=perplexity \
        --x_axis=step --baseline=23.13 --baseline_name="unigram baseline"

Reads `model_dir/train` and `model_dir/eval` (written by the Controller).
Per epoch (the default): steps become epochs with the run's recorded
`global_batch_size` and `--train_examples`, and the values of an epoch are
averaged. Per step: the values as logged. Prints a table and draws a PNG
with PIL only (matplotlib is not a dependency); an accuracy in percent,
any other tag (loss, perplexity) on its own scale.
"""

import json
import os
import re

try:  # Installed: the package distloop_cli.
  from . import cli  # pylint: disable=g-import-not-at-top
except ImportError:  # python scripts/<app>.py
  from distloop_cli import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()  # Before TensorFlow is imported.
try:
  from .curves import (draw, format_value, is_fraction, per_epoch,  # pylint: disable=g-import-not-at-top
                       read_scalars)
except ImportError:
  from distloop_cli.curves import (draw, format_value, is_fraction,  # pylint: disable=g-import-not-at-top
                                   per_epoch, read_scalars)

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", None, "The run's model_dir.")
flags.DEFINE_string("output", None, "PNG path (default: "
                    "model_dir/TAG.png, TAG the --tag).")
flags.DEFINE_integer("train_examples", 50000, "Training examples per epoch.")
flags.DEFINE_string("tag", "accuracy", "The scalar to plot.")
flags.DEFINE_string("output_json", None, "Also write the plotted values.")
flags.DEFINE_enum("x_axis", "epoch", ["epoch", "step"], "Per epoch (values "
                  "averaged over each epoch) or per step (as logged).")
flags.DEFINE_float("baseline", None, "Also draw this value as a horizontal "
                   "line (e.g. the unigram perplexity of a language model).")
flags.DEFINE_string("baseline_name", "baseline", "The baseline's name in the "
                    "legend.")
flags.mark_flag_as_required("model_dir")

def main(argv):
  del argv
  with cli.one_line_errors():
    plot()


def plot():
  """Reads the flags' run, prints its table, writes the PNG (and JSON)."""
  # Here, not at the top: TensorFlow's own flags must not become this app's.
  from framework.core.checkpoints import run_files  # pylint: disable=g-import-not-at-top
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  if not os.path.isdir(FLAGS.model_dir):
    raise ConfigError(f"model_dir={FLAGS.model_dir!r} is not a folder")
  train, texts = read_scalars(os.path.join(FLAGS.model_dir, "train"))
  test, _ = read_scalars(os.path.join(FLAGS.model_dir, "eval"))
  points = {"train": train.get(FLAGS.tag, []), "test": test.get(FLAGS.tag, [])}
  if not any(points.values()):
    raise ConfigError(
        f"no {FLAGS.tag!r} scalars in {FLAGS.model_dir}/train or /eval (its "
        f"tags: {', '.join(sorted(set(train) | set(test))) or 'none'})")
  if FLAGS.x_axis == "step":
    curves = {name: dict(p) for name, p in points.items()}
  else:
    match = re.search(r"\| global_batch_size \| (\d+) \|",
                      texts.get("flags", ""))
    if not match:
      raise ConfigError(f"no recorded global_batch_size in "
                        f"{FLAGS.model_dir}/train (not a distloop run?); "
                        "--x_axis=step needs none")
    steps_per_epoch = FLAGS.train_examples // int(match.group(1))
    curves = {name: per_epoch(p, steps_per_epoch)
              for name, p in points.items()}
  percent = is_fraction(FLAGS.tag, [v for c in curves.values()
                                    for v in c.values()])
  print(f"{FLAGS.x_axis:>6}{'train':>10}{'test':>10}")
  for x in sorted(set(curves["train"]) | set(curves["test"])):
    row = [curves[k].get(x) for k in ("train", "test")]
    print(f"{x:>6}" + "".join(
        f"{format_value(v, percent):>10}" if v is not None else f"{'-':>10}"
        for v in row))
  if FLAGS.baseline is not None:
    xs = [x for c in curves.values() for x in c]
    curves[FLAGS.baseline_name] = {0: FLAGS.baseline,
                                   max(xs): FLAGS.baseline}
    print(f"{FLAGS.baseline_name}: {format_value(FLAGS.baseline, percent)}")
  output = FLAGS.output or os.path.join(FLAGS.model_dir, f"{FLAGS.tag}.png")
  # Complete or as before: the PNG may land in the run's own folder.
  run_files.write_atomically(output, lambda tmp: draw(
      curves, tmp, f"{FLAGS.tag}: {FLAGS.model_dir}", x_label=FLAGS.x_axis,
      percent=percent))
  print(f"wrote {output}")
  if FLAGS.output_json:
    run_files.write_text(FLAGS.output_json, json.dumps(curves, indent=2))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
