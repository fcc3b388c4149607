"""Evaluates a training run's checkpoint on the whole test set.

    python scripts/evaluate.py --model_dir=runs/cifar            # latest
    python scripts/evaluate.py --model_dir=runs/cifar --checkpoint=runs/cifar/ckpt-2000
    python scripts/evaluate.py --model_dir=runs/cifar --watch    # side-car
    python scripts/evaluate.py --model_dir=runs/cifar --weights=best

Prints loss, accuracy (pixel accuracy and mean IoU for segmentation) and the
confusion matrix, and writes them to TensorBoard under
<model_dir>/eval_standalone (--eval_name=NAME: <model_dir>/eval_NAME;
--eval_dir: any folder), never into the run's own <model_dir>/eval.
With --watch it evaluates each new checkpoint as the run writes it and exits
after the run's last step; if no checkpoint appears within --timeout_seconds
it exits 1 with one line (nothing evaluated).
"""

import os

from absl import app  # pylint: disable=g-import-not-at-top
try:  # Installed: the package distloop_cli.
  from . import cli  # pylint: disable=g-import-not-at-top
except ImportError:  # python scripts/<app>.py
  from distloop_cli import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()  # Before TensorFlow is imported.
from absl import flags
try:  # No TensorFlow in them: the flags come first.
  from . import config_flags  # pylint: disable=g-import-not-at-top
except ImportError:
  from distloop_cli import config_flags  # pylint: disable=g-import-not-at-top
from framework.app.config import EvalConfig  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS

# The settings of an evaluation: one flag per field of EvalConfig
# (framework/app/config.py; see scripts/config_flags.py).
EVAL_FLAGS = config_flags.define_flags(cls=EvalConfig)
# Not settings of the evaluation: how this app picks its checkpoints and
# devices.
flags.DEFINE_enum("weights", "latest", ["latest", "best"], "best: the best "
                  "checkpoint (<model_dir>/best/, kept by train.py "
                  "--best_metric); latest: --checkpoint or the newest.")
flags.DEFINE_bool("watch", False, "Evaluate each new checkpoint until the "
                  "run's last step.")
flags.DEFINE_integer("cpu_devices", None, "Split the CPU into this many "
                     "logical devices.")
# Which choices read a flag (every other flag is read by every run; the
# settings declare theirs): a set flag they do not read is one warning line,
# which names the --watch settings first.
READ_BY = dict(sorted(config_flags.read_by_table(cls=EvalConfig).items(),
                      key=lambda item: "watch" not in item[1]))


def run():
  """Evaluates (or watches); raises DistloopError on bad input."""
  import framework  # pylint: disable=g-import-not-at-top
  from framework.app import evaluation  # pylint: disable=g-import-not-at-top
  cli.warn_unread_flags(table=READ_BY)
  if FLAGS.cpu_devices:
    framework.configure_cpu_devices(FLAGS.cpu_devices)
  if FLAGS.watch and FLAGS.checkpoint:
    raise framework.ConfigError("--watch evaluates new checkpoints; it "
                                "cannot be combined with --checkpoint")
  checkpoint = FLAGS.checkpoint
  if FLAGS.weights == "best":
    if FLAGS.watch or FLAGS.checkpoint:
      raise framework.ConfigError(
          "--weights=best evaluates the best checkpoint; it cannot be "
          "combined with --watch or --checkpoint")
    from framework.core.checkpoints import best  # pylint: disable=g-import-not-at-top
    checkpoint = best.resolve(FLAGS.model_dir)
  config = config_flags.build_config(EvalConfig, checkpoint=checkpoint)
  if FLAGS.watch:
    results = evaluation.watch(config)
  else:
    if not os.path.isdir(FLAGS.model_dir):
      raise framework.CheckpointError(
          f"model_dir={FLAGS.model_dir!r} does not exist")
    results = [evaluation.Evaluator(config).evaluate()]
  for result in results:
    print("\n".join(result.lines()), flush=True)


main = cli.main_running(run)


def entry():
  """Console entry point `distloop-evaluate`."""
  cli.run_entry_point(main, __name__)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
