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

FLAGS = flags.FLAGS

flags.DEFINE_string("model_dir", None, "The training run's directory.")
flags.DEFINE_string("checkpoint", None, "A checkpoint path (.../ckpt-N); "
                    "default: the latest in --model_dir.")
flags.DEFINE_enum("weights", "latest", ["latest", "best"], "best: the best "
                  "checkpoint (<model_dir>/best/, kept by train.py "
                  "--best_metric); latest: --checkpoint or the newest.")
flags.DEFINE_bool("watch", False, "Evaluate each new checkpoint until the "
                  "run's last step.")
flags.DEFINE_float("poll_seconds", 5.0, "--watch: seconds between looks for "
                   "a new checkpoint.")
flags.DEFINE_float("timeout_seconds", 3600.0, "--watch: stop after this long "
                   "without a new checkpoint (exit 1 if none came at all).")
flags.DEFINE_enum("strategy", "default", ["default", "one_device", "mirrored",
                                          "multi_worker_mirrored",
                                          "central_storage", "tpu"],
                  "tf.distribute strategy for evaluation.")
flags.DEFINE_integer("cpu_devices", None, "Split the CPU into this many "
                     "logical devices.")
flags.DEFINE_string("tpu", None, "TPU for --strategy=tpu.")
flags.DEFINE_string("dataset", None, "Default: the run's dataset.")
flags.DEFINE_string("data_dir", None, "Default: the run's data_dir.")
flags.DEFINE_integer("global_batch_size", None, "Default: the run's.")
flags.DEFINE_string("eval_dir", None, "TensorBoard directory (default: "
                    "<model_dir>/eval_<eval_name>); never the run's own "
                    "<model_dir>/eval.")
flags.DEFINE_string("eval_name", "standalone", "Names the default "
                    "--eval_dir: <model_dir>/eval_<eval_name>.")
flags.DEFINE_string("model", None, "The model (registered name or "
                    "package.module:function) instead of model_info.json's; "
                    "naming a module trusts its code.")
flags.DEFINE_bool("trust_model_code", False, "Import the module:function "
                  "that model_info.json names (runs that module's code; off "
                  "by default, as Keras's safe_mode).")
flags.mark_flag_as_required("model_dir")
# Which choices read a flag (every other flag is read by every run): a set
# flag they do not read is one warning line.
READ_BY = {"poll_seconds": {"watch": ("true",)},
           "timeout_seconds": {"watch": ("true",)},
           "tpu": {"strategy": ("tpu",)}}


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
    from framework.core import best_checkpoint  # pylint: disable=g-import-not-at-top
    checkpoint = best_checkpoint.resolve(FLAGS.model_dir)
  config = evaluation.EvalConfig(
      model_dir=FLAGS.model_dir, checkpoint=checkpoint,
      strategy=FLAGS.strategy, tpu=FLAGS.tpu, dataset=FLAGS.dataset,
      data_dir=FLAGS.data_dir, global_batch_size=FLAGS.global_batch_size,
      eval_dir=FLAGS.eval_dir, eval_name=FLAGS.eval_name,
      poll_seconds=FLAGS.poll_seconds,
      timeout_seconds=FLAGS.timeout_seconds, model=FLAGS.model,
      trust_model_code=FLAGS.trust_model_code)
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
