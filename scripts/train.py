"""Trains a model by name under any tf.distribute strategy.

    python scripts/train.py --model=cifar_cnn --data_dir=.../cifar-10-batches-py \
        --strategy=mirrored --global_batch_size=1024 --epochs=50 \
        --model_dir=runs/cifar

Flags are the only configuration; `--flagfile=scripts/configs/<run>.cfg`
replays a recorded experiment.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
from absl import logging

FLAGS = flags.FLAGS
_FLAGS_BEFORE = set(FLAGS)

# What to train.
flags.DEFINE_string("model", "cifar_cnn", "Model name (see models/).")
flags.DEFINE_string("dataset", "cifar10", "cifar10 or synthetic.")
flags.DEFINE_string("data_dir", None, "CIFAR-10 python directory; default: "
                    "Keras's cache (~/.keras/datasets/cifar-10-batches-py).")
flags.DEFINE_list("hidden_units", ["64", "64"], "mlp: hidden layer sizes.")
flags.DEFINE_bool("dropout", True, "cifar_cnn: keep the Dropout layers.")
flags.DEFINE_bool("sync_batch_norm", False, "BatchNorm statistics over all "
                  "replicas (Keras synchronized=True).")
# Where.
flags.DEFINE_enum("strategy", "default", ["default", "one_device", "mirrored",
                                          "multi_worker_mirrored",
                                          "central_storage",
                                          "parameter_server", "tpu"],
                  "tf.distribute strategy.")
flags.DEFINE_integer("cpu_devices", None, "Split the CPU into this many "
                     "logical devices (replicas when there is no GPU).")
flags.DEFINE_string("tpu", None, "TPU name or grpc://host:port for "
                    "--strategy=tpu.")
flags.DEFINE_enum("input_mode", "global", ["global", "per_replica"],
                  "global: experimental_distribute_dataset; per_replica: "
                  "distribute_datasets_from_function.")
# How long and how.
flags.DEFINE_integer("global_batch_size", 128, "Examples per step, all "
                     "replicas together.")
flags.DEFINE_integer("train_steps", None, "Global steps (or --epochs).")
flags.DEFINE_integer("epochs", None, "Epochs (or --train_steps).")
flags.DEFINE_integer("steps_per_loop", 100, "Steps inside one tf.function.")
flags.DEFINE_integer("grad_accum_steps", 1, "Split each replica's batch into "
                     "this many micro-batches; one all-reduce and update per "
                     "step (same update, less activation memory).")
flags.DEFINE_enum("mixed_precision", "float32",
                  ["float32", "bfloat16", "float16"], "Compute dtype "
                  "(float32 variables); float16 uses dynamic loss scaling.")
flags.DEFINE_enum("augment", "none", ["none", "crop_flip"], "Training "
                  "augmentation: crop_flip = 4-pixel random crop + "
                  "horizontal flip.")
flags.DEFINE_enum("optimizer", "adam", ["sgd", "momentum", "adam", "adamw"],
                  "Optimizer.")
flags.DEFINE_float("learning_rate", 1e-3, "Peak learning rate.")
flags.DEFINE_float("momentum", 0.9, "Momentum for --optimizer=momentum.")
flags.DEFINE_float("weight_decay", 1e-4, "Decoupled weight decay (adamw).")
flags.DEFINE_enum("lr_schedule", "constant", ["constant", "cosine", "step"],
                  "Learning-rate schedule after warm-up.")
flags.DEFINE_integer("warmup_steps", 0, "Linear warm-up steps.")
flags.DEFINE_list("lr_step_boundaries", [], "Steps where --lr_schedule=step "
                  "multiplies the rate by --lr_step_decay.")
flags.DEFINE_float("lr_step_decay", 0.1, "Factor at each step boundary.")
flags.DEFINE_float("clip_norm", None, "Clip the all-reduced gradient to this "
                   "global norm.")
flags.DEFINE_enum("nan_policy", "stop", ["stop", "skip"], "On a NaN/Inf "
                  "loss: stop (keep the last good checkpoint) or skip the "
                  "step.")
flags.DEFINE_integer("seed", 0, "Seed for weights, data order and "
                     "augmentation.")
flags.DEFINE_bool("deterministic", True, "Deterministic TensorFlow ops "
                  "(exact resume).")
# Outputs.
flags.DEFINE_string("model_dir", "/tmp/distloop", "Checkpoints, TensorBoard "
                    "(train/, eval/) and the final weights.")
flags.DEFINE_integer("checkpoint_every", 1000, "Steps between checkpoints "
                     "(0: only at the end).")
flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints to keep.")
flags.DEFINE_integer("eval_every", 0, "Steps between evaluations (0: only at "
                     "the end).")
flags.DEFINE_integer("summary_every", 100, "Steps between train summaries.")
flags.DEFINE_integer("log_every", 100, "Steps between progress lines.")

# Recorded in TensorBoard as the run's configuration.
TRAIN_FLAGS = sorted(set(FLAGS) - _FLAGS_BEFORE)

for _name in ("global_batch_size", "steps_per_loop", "keep_checkpoints",
              "grad_accum_steps"):
  flags.register_validator(_name, lambda v: v is not None and v > 0,
                           message=f"--{_name} must be a positive integer")
for _name in ("train_steps", "epochs", "cpu_devices"):
  flags.register_validator(_name, lambda v: v is None or v > 0,
                           message=f"--{_name} must be a positive integer")
for _name in ("checkpoint_every", "eval_every", "summary_every", "log_every"):
  flags.register_validator(_name, lambda v: v is not None and v >= 0,
                           message=f"--{_name} must be >= 0")


def _int_list(name, values):
  try:
    return tuple(int(v) for v in values)
  except ValueError:
    raise app.UsageError(f"--{name}={','.join(values)} must be integers")


def config_from_flags():
  """The ExperimentConfig described by the command line."""
  from framework import ExperimentConfig, LoopConfig, OptimizerConfig  # pylint: disable=g-import-not-at-top
  optimizer = OptimizerConfig(
      name=FLAGS.optimizer, learning_rate=FLAGS.learning_rate,
      momentum=FLAGS.momentum, weight_decay=FLAGS.weight_decay,
      schedule=FLAGS.lr_schedule, warmup_steps=FLAGS.warmup_steps,
      step_boundaries=_int_list("lr_step_boundaries",
                                FLAGS.lr_step_boundaries),
      step_decay=FLAGS.lr_step_decay)
  loop = LoopConfig(
      train_steps=1, steps_per_loop=FLAGS.steps_per_loop,
      checkpoint_every=FLAGS.checkpoint_every,
      keep_checkpoints=FLAGS.keep_checkpoints, eval_every=FLAGS.eval_every,
      summary_every=FLAGS.summary_every, log_every=FLAGS.log_every)
  hparams = {name: FLAGS[name].value for name in TRAIN_FLAGS}
  return ExperimentConfig(
      model=FLAGS.model, dataset=FLAGS.dataset, data_dir=FLAGS.data_dir,
      model_dir=FLAGS.model_dir, strategy=FLAGS.strategy, tpu=FLAGS.tpu,
      global_batch_size=FLAGS.global_batch_size,
      train_steps=FLAGS.train_steps, epochs=FLAGS.epochs,
      optimizer=optimizer, clip_norm=FLAGS.clip_norm,
      nan_policy=FLAGS.nan_policy, loop=loop, seed=FLAGS.seed,
      deterministic=FLAGS.deterministic, input_mode=FLAGS.input_mode,
      grad_accum_steps=FLAGS.grad_accum_steps,
      mixed_precision=FLAGS.mixed_precision, augment=FLAGS.augment,
      model_options=dict(
          hidden_units=_int_list("hidden_units", FLAGS.hidden_units),
          dropout=FLAGS.dropout, sync_batch_norm=FLAGS.sync_batch_norm),
      hparams=hparams)


def run_main(trainer_cls=None):
  """Runs the app; errors a user can fix end in one line and exit code 1."""
  import framework  # pylint: disable=g-import-not-at-top
  try:
    if FLAGS.cpu_devices:
      # Must happen before TensorFlow creates its devices.
      framework.configure_cpu_devices(FLAGS.cpu_devices)
    config = config_from_flags()
    results = framework.experiment.run(
        config, trainer_cls=trainer_cls or framework.Trainer)
  except framework.DistloopError as e:
    print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
    sys.exit(1)
  if results:
    logging.info("final eval: %s", results)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  run_main()


def entry():
  """Console entry point `distloop-train`."""
  app.run(main)


if __name__ == "__main__":
  app.run(main)
