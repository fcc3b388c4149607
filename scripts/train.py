"""Trains a model by name under any tf.distribute strategy.

    python scripts/train.py --model=cifar_cnn --data_dir=.../cifar-10-batches-py \
        --strategy=mirrored --global_batch_size=1024 --epochs=50 \
        --model_dir=runs/cifar

Flags are the only configuration; `--flagfile=scripts/configs/<run>.cfg`
replays a recorded experiment.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
try:  # Installed: the package distloop_cli.
  from . import cli  # pylint: disable=g-import-not-at-top
except ImportError:  # python scripts/<app>.py
  from scripts import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()  # Before TensorFlow is imported.
from absl import flags
from absl import logging

FLAGS = flags.FLAGS
_FLAGS_BEFORE = set(FLAGS)

# What to train.
flags.DEFINE_string("model", "cifar_cnn", "Model name (see models/).")
flags.DEFINE_string("dataset", "cifar10", "cifar10, synthetic, shapes "
                    "(generated segmentation) or oxford_pet (in memory); "
                    "tfrecord (--data_dir written by make_tfrecords.py), "
                    "image_folder (--data_dir/<class>/*.png|jpg) or "
                    "tfds:NAME[:VERSION] (prepared under --data_dir; "
                    'pip install -e ".[tfds]"), streamed.')
flags.DEFINE_string("data_dir", None, "CIFAR-10 python directory (default: "
                    "Keras's cache, ~/.keras/datasets/cifar-10-batches-py) "
                    "or the Oxford-IIIT Pet directory.")
flags.DEFINE_integer("image_size", 128, "shapes, oxford_pet: side of the "
                     "square images (tfds: of images without a fixed size).")
flags.DEFINE_string("label_key", "label", "tfds: the feature used as label: "
                    "a ClassLabel, or an image mask (e.g. segmentation_mask).")
flags.DEFINE_string("image_key", "image", "tfds: the image feature.")
flags.DEFINE_enum("file_shuffle", "shards", ["shards", "global"],
                  "Streamed datasets: 'shards' shuffles groups of 4 shards "
                  "(memory: a few shards); 'global' orders each epoch as "
                  "the in-memory arrays are (on one worker the very same "
                  "batches; memory: the encoded training split).")
flags.DEFINE_list("hidden_units", ["64", "64"], "mlp: hidden layer sizes.")
flags.DEFINE_bool("dropout", True, "cifar_cnn: keep the Dropout layers.")
flags.DEFINE_integer("unet_depth", 4, "unet: down-sampling levels.")
flags.DEFINE_integer("unet_width", 32, "unet: filters of the first level.")
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
# Model parallelism (one replica: --strategy=default, devices from
# --cpu_devices or the GPUs).
flags.DEFINE_enum("model_parallel", "none", ["none", "pipeline", "tensor"],
                  "pipeline: cut the layers into --num_stages stages on as "
                  "many devices; tensor: split one hidden Dense layer's units "
                  "across --num_shards devices.")
flags.DEFINE_integer("num_stages", 2, "Pipeline stages (devices).")
flags.DEFINE_integer("num_microbatches", 1, "Micro-batches per global batch "
                     "(GPipe schedule); must divide --global_batch_size.")
flags.DEFINE_list("stage_boundaries", [], "Pipeline cut points between "
                  "layers, e.g. '3', '2,5' or layer names (a name starts a "
                  "stage); default: balanced by --stage_balance.")
flags.DEFINE_enum("stage_balance", "flops", ["flops", "params"],
                  "Pipeline cut points without --stage_boundaries: equal "
                  "forward+backward conv/matmul FLOPs per stage, or equal "
                  "parameter counts.")
flags.DEFINE_bool("recompute", False, "Model parallel: keep only each "
                  "stage's inputs per micro-batch and recompute its forward "
                  "pass in the backward pass (less activation memory, one "
                  "more forward pass per step).")
flags.DEFINE_bool("serial_stages", False, "Model parallel: each stage "
                  "device runs its ops one at a time, in program order, as a "
                  "GPU stream does (logical CPU devices otherwise run "
                  "several of a stage's ops at once on the shared cores).")
flags.DEFINE_bool("input_grads_first", True, "Model parallel, with "
                  "--serial_stages: each stage computes the input gradient "
                  "it sends back before its weight gradients (B before W, "
                  "as zero-bubble pipelines do: a smaller bubble); false: "
                  "the backward pass in creation order.")
flags.DEFINE_enum("model_parallel_devices", "local", ["local", "cluster"],
                  "local: this process's GPUs or --cpu_devices; cluster: "
                  "stage/shard i on TF_CONFIG's worker i, the chief runs the "
                  "loop (scripts/launch.py --workers=N adds the chief).")
flags.DEFINE_integer("num_shards", 2, "Tensor parallel: devices the hidden "
                     "units are split across.")
flags.DEFINE_integer("split_layer", None, "Tensor parallel: index of the "
                     "Dense layer to split (default: the last Dense followed "
                     "by a Dense).")
# How long and how.
flags.DEFINE_integer("global_batch_size", 128, "Examples per step, all "
                     "replicas together.")
flags.DEFINE_integer("train_steps", None, "Global steps (or --epochs); 0 "
                     "unsets it, e.g. to override a flag file's --epochs.")
flags.DEFINE_integer("epochs", None, "Epochs (or --train_steps); 0 unsets "
                     "it, e.g. to override a flag file's --train_steps.")
flags.DEFINE_integer("steps_per_loop", 100, "Steps inside one tf.function.")
flags.DEFINE_integer("grad_accum_steps", 1, "Split each replica's batch into "
                     "this many micro-batches; one all-reduce and update per "
                     "step (same update, less activation memory).")
flags.DEFINE_enum("mixed_precision", "float32",
                  ["float32", "bfloat16", "float16", "auto"], "Compute dtype "
                  "(float32 variables); float16 uses dynamic loss scaling; "
                  "auto: bfloat16 on CPUs with AVX512_BF16/AMX-BF16 or GPUs "
                  "with native bfloat16, else float32 (logged).")
flags.DEFINE_enum("onednn", "default", ["default", "on", "off"],
                  "TensorFlow's oneDNN CPU kernels (TF_ENABLE_ONEDNN_OPTS, "
                  "read once when TensorFlow loads, so set here before it "
                  "does): default keeps TensorFlow's choice (on only for "
                  "CPUs with AVX512_VNNI/BF16 or AMX); on: ~1.5x faster "
                  "conv training steps on an AVX2-only CPU, results differ "
                  "from Eigen's kernels by rounding. Logged.")
flags.DEFINE_enum("augment", "none", ["none", "flip", "crop_flip"], "Training "
                  "augmentation: crop_flip = 4-pixel random crop + "
                  "horizontal flip.")
flags.DEFINE_enum("optimizer", "adam", ["sgd", "momentum", "adam", "adamw"],
                  "Optimizer.")
flags.DEFINE_float("learning_rate", 1e-3, "Peak learning rate.")
flags.DEFINE_float("momentum", 0.9, "Momentum for --optimizer=momentum.")
flags.DEFINE_float("weight_decay", 1e-4, "Decoupled weight decay (adamw).")
flags.DEFINE_enum("lr_schedule", "constant", ["constant", "cosine", "step",
                                              "linear", "onecycle"],
                  "Learning-rate schedule after warm-up. linear: straight "
                  "down to --lr_min_ratio x peak at the last step; onecycle: "
                  "linear whose warm-up defaults to the first 30 % of the "
                  "run.")
flags.DEFINE_float("lr_min_ratio", 0.0, "cosine, linear, onecycle: final "
                   "learning rate as a fraction of the peak.")
flags.DEFINE_bool("nesterov", False, "Nesterov momentum for "
                  "--optimizer=momentum.")
flags.DEFINE_enum("lr_scaling", "none", ["none", "linear", "sqrt"],
                  "Scale --learning_rate from --lr_base_batch_size to "
                  "--global_batch_size (linear: by the ratio; sqrt: by its "
                  "square root).")
flags.DEFINE_integer("lr_base_batch_size", 256, "The global batch "
                     "--learning_rate is given for (with --lr_scaling).")
flags.DEFINE_float("label_smoothing", 0.0, "Label smoothing of the "
                   "cross-entropy, in [0, 1).")
flags.DEFINE_float("ema_decay", None, "Keep an exponential moving average "
                   "of the weights with this decay (e.g. 0.99); evaluation "
                   "and model.weights.h5 / the SavedModel use it "
                   "(model.raw.weights.h5: the raw weights); 0 unsets it, "
                   "e.g. to override a flag file's.")
flags.DEFINE_bool("ema_warmup", False, "EMA decay min(ema_decay, "
                  "(1+n)/(10+n)) at update n: forgets the initial weights "
                  "quickly in short runs.")
flags.DEFINE_enum("eval_tta", "none", ["none", "flip"], "Test-time "
                  "augmentation in evaluation: flip averages the logits of "
                  "each image and its horizontal mirror.")
flags.DEFINE_integer("warmup_steps", 0, "Linear warm-up steps.")
flags.DEFINE_list("lr_step_boundaries", [], "Steps where --lr_schedule=step "
                  "multiplies the rate by --lr_step_decay.")
flags.DEFINE_float("lr_step_decay", 0.1, "Factor at each step boundary.")
flags.DEFINE_integer("all_reduce_bytes_per_pack", 0, "Pack the gradients "
                     "into all-reduces of about this many bytes each (0: one "
                     "all-reduce for all); collective strategies "
                     "(multi_worker_mirrored) only.", lower_bound=0)
flags.DEFINE_enum("all_reduce_implementation", "auto",
                  ["auto", "ring", "nccl"], "Collective all-reduce "
                  "implementation (nccl: GPUs only).")
flags.DEFINE_enum("all_reduce_dtype", "float32", ["float32", "bfloat16"],
                  "dtype of the gradients on the wire: bfloat16 halves the "
                  "bytes; the update is applied in float32.")
flags.DEFINE_float("clip_norm", None, "Clip the all-reduced gradient to this "
                   "global norm.")
flags.DEFINE_enum("nan_policy", "stop", ["stop", "skip"], "On a NaN/Inf "
                  "loss: stop (keep the last good checkpoint) or skip the "
                  "step.")
flags.DEFINE_integer("max_skipped_steps", 10, "--nan_policy=skip: stop with "
                     "an error (saving nothing) after this many skipped "
                     "steps in a row.")
flags.DEFINE_bool("check_distribution", False, "Before training, run one "
                  "step under --strategy and on one device from the same "
                  "state and compare (exits 1 if the step is wrong when "
                  "distributed); run it first after writing a custom step.")
flags.DEFINE_integer("seed", 0, "Seed for weights, data order and "
                     "augmentation.")
flags.DEFINE_bool("deterministic", True, "Deterministic TensorFlow ops "
                  "(exact resume).")
# Outputs.
flags.DEFINE_string("model_dir", "/tmp/distloop", "Checkpoints, TensorBoard "
                    "(train/, eval/) and the final weights.")
flags.DEFINE_bool("export_saved_model", True, "At the end, also write a "
                  "SavedModel with a serving signature to <model_dir>/export "
                  "(the weights file is always written).")
flags.DEFINE_integer("checkpoint_every", 1000, "Steps between checkpoints "
                     "(0: only at the end).")
flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints to keep.")
flags.DEFINE_enum("restore", "latest_intact", ["latest_intact", "error"],
                  "A damaged newest checkpoint: latest_intact = warn and "
                  "resume from the newest intact one; error = stop.")
flags.DEFINE_bool("allow_config_change", False, "Resume although --model, "
                  "its options, --optimizer, --global_batch_size or "
                  "--dataset differ from the checkpoint's (e.g. "
                  "fine-tuning); otherwise that is an error.")
flags.DEFINE_integer("eval_every", 0, "Steps between evaluations (0: only at "
                     "the end).")
flags.DEFINE_integer("eval_start_step", 0, "Periodic evaluations "
                     "(--eval_every) only from this step on.")
flags.DEFINE_float("stop_at_accuracy", None, "Stop after the first evaluation "
                   "whose accuracy reaches this fraction (e.g. 0.8079); logs "
                   "and writes eval/time_to_target_seconds (wall time from "
                   "the run's start: data loading, steps and evaluations "
                   "included).")
flags.DEFINE_integer("summary_every", 100, "Steps between train summaries.")
flags.DEFINE_integer("log_every", 100, "Steps between progress lines.")
flags.DEFINE_list("profile_steps", [], "first,last: trace these global steps "
                  "(inclusive) with TensorFlow's profiler into "
                  "model_dir/train (TensorBoard's Profile tab) and log the "
                  "time per op type, e.g. 10,14.")
# Multi-process jobs.
flags.DEFINE_enum("cluster_resolver", "tf_config", ["tf_config", "slurm"],
                  "Where the cluster comes from: the TF_CONFIG environment "
                  "variable, or Slurm's (srun) variables through "
                  "SlurmClusterResolver.")
flags.DEFINE_integer("slurm_ps_tasks", 0, "--cluster_resolver=slurm: number "
                     "of ps tasks (task 0 is then the chief).")
flags.DEFINE_integer("slurm_port_base", 8888, "--cluster_resolver=slurm: "
                     "first gRPC port on each node.")
flags.DEFINE_float("startup_timeout", 120, "Seconds to wait for every task "
                   "of a multi-worker/parameter-server cluster to start "
                   "before exiting with the missing tasks named (0: wait "
                   "forever).")

# Recorded in TensorBoard as the run's configuration.
TRAIN_FLAGS = sorted(set(FLAGS) - _FLAGS_BEFORE)


def _is_int_list(values):
  try:
    [int(v) for v in values]  # pylint: disable=expression-not-assigned
  except ValueError:
    return False
  return True


for _name in ("global_batch_size", "steps_per_loop", "keep_checkpoints",
              "grad_accum_steps", "max_skipped_steps"):
  flags.register_validator(_name, lambda v: v is not None and v > 0,
                           message=f"--{_name} must be a positive integer")
for _name in ("train_steps", "epochs"):
  flags.register_validator(_name, lambda v: v is None or v >= 0,
                           message=f"--{_name} must be >= 0 (0: not set)")
for _name in ("cpu_devices", "image_size", "unet_depth", "unet_width"):
  flags.register_validator(_name, lambda v: v is None or v > 0,
                           message=f"--{_name} must be a positive integer")
for _name in ("hidden_units", "lr_step_boundaries", "profile_steps"):
  flags.register_validator(_name, _is_int_list,
                           message=f"--{_name} must be integers separated "
                           "by commas")
for _name in ("checkpoint_every", "eval_every", "summary_every", "log_every",
              "startup_timeout", "eval_start_step"):
  flags.register_validator(_name, lambda v: v is not None and v >= 0,
                           message=f"--{_name} must be >= 0")


def _int_list(values):
  return tuple(int(v) for v in values)  # checked by the flag validators


def config_from_flags():
  """The ExperimentConfig described by the command line."""
  from framework import ExperimentConfig, LoopConfig, OptimizerConfig  # pylint: disable=g-import-not-at-top
  from framework.model_parallel import ModelParallelConfig  # pylint: disable=g-import-not-at-top
  from framework.core.communication import AllReduceConfig  # pylint: disable=g-import-not-at-top
  optimizer = OptimizerConfig(
      name=FLAGS.optimizer, learning_rate=FLAGS.learning_rate,
      momentum=FLAGS.momentum, weight_decay=FLAGS.weight_decay,
      schedule=FLAGS.lr_schedule, warmup_steps=FLAGS.warmup_steps,
      step_boundaries=_int_list(FLAGS.lr_step_boundaries),
      step_decay=FLAGS.lr_step_decay, min_lr_ratio=FLAGS.lr_min_ratio,
      nesterov=FLAGS.nesterov, lr_scaling=FLAGS.lr_scaling,
      base_batch_size=FLAGS.lr_base_batch_size)
  loop = LoopConfig(
      train_steps=1, steps_per_loop=FLAGS.steps_per_loop,
      checkpoint_every=FLAGS.checkpoint_every,
      keep_checkpoints=FLAGS.keep_checkpoints, eval_every=FLAGS.eval_every,
      summary_every=FLAGS.summary_every, log_every=FLAGS.log_every,
      profile_steps=_int_list(FLAGS.profile_steps),
      stop_at_accuracy=FLAGS.stop_at_accuracy,
      eval_start_step=FLAGS.eval_start_step)
  model_parallel = ModelParallelConfig(
      mode=FLAGS.model_parallel, num_stages=FLAGS.num_stages,
      num_microbatches=FLAGS.num_microbatches,
      stage_boundaries=tuple(int(v) if v.lstrip("-").isdigit() else v
                             for v in FLAGS.stage_boundaries),
      num_shards=FLAGS.num_shards, split_layer=FLAGS.split_layer,
      devices=FLAGS.model_parallel_devices, recompute=FLAGS.recompute,
      serial_stages=FLAGS.serial_stages,
      input_grads_first=FLAGS.input_grads_first,
      stage_balance=FLAGS.stage_balance)
  hparams = {name: FLAGS[name].value for name in TRAIN_FLAGS}
  return ExperimentConfig(
      model=FLAGS.model, dataset=FLAGS.dataset, data_dir=FLAGS.data_dir,
      model_dir=FLAGS.model_dir, strategy=FLAGS.strategy, tpu=FLAGS.tpu,
      global_batch_size=FLAGS.global_batch_size,
      train_steps=FLAGS.train_steps or None, epochs=FLAGS.epochs or None,
      optimizer=optimizer, clip_norm=FLAGS.clip_norm,
      nan_policy=FLAGS.nan_policy, max_skipped_steps=FLAGS.max_skipped_steps,
      loop=loop, seed=FLAGS.seed,
      deterministic=FLAGS.deterministic, input_mode=FLAGS.input_mode,
      grad_accum_steps=FLAGS.grad_accum_steps,
      mixed_precision=FLAGS.mixed_precision, augment=FLAGS.augment,
      model_options=dict(
          hidden_units=_int_list(FLAGS.hidden_units),
          dropout=FLAGS.dropout, sync_batch_norm=FLAGS.sync_batch_norm,
          depth=FLAGS.unet_depth, width=FLAGS.unet_width),
      dataset_options=dict(image_size=FLAGS.image_size, **(
          dict(image_key=FLAGS.image_key, label_key=FLAGS.label_key)
          if FLAGS.dataset.startswith("tfds:") else {}), **(
              dict(file_shuffle=FLAGS.file_shuffle)
              if FLAGS.file_shuffle != "shards" else {})),
      export_saved_model=FLAGS.export_saved_model,
      hparams=hparams, check_distribution=FLAGS.check_distribution,
      model_parallel=model_parallel, restore=FLAGS.restore,
      allow_config_change=FLAGS.allow_config_change,
      label_smoothing=FLAGS.label_smoothing,
      ema_decay=FLAGS.ema_decay or None,
      ema_warmup=FLAGS.ema_warmup, eval_tta=FLAGS.eval_tta,
      all_reduce=AllReduceConfig(
          bytes_per_pack=FLAGS.all_reduce_bytes_per_pack,
          implementation=FLAGS.all_reduce_implementation,
          dtype=FLAGS.all_reduce_dtype))


def _run_config(config, trainer_cls):
  """Runs `config` as this process's task; returns the final eval metrics.

  Cluster strategies: `ps` tasks, and `worker` tasks under parameter_server,
  only serve; the chief coordinates. A start-up watchdog turns a task that
  never starts into an error, and SIGTERM saves a checkpoint and exits with
  status 42 (see framework/core/preemption.py).
  """
  # pylint: disable=g-import-not-at-top
  from framework.app import experiment
  from framework.core import preemption
  from framework.distribute import cluster
  from framework.distribute.tf_config import require_tf_config
  # pylint: enable=g-import-not-at-top
  logging.info("oneDNN CPU kernels: %s (--onednn=%s)",
               "on" if cli.onednn_enabled() else "off", FLAGS.onednn)
  tf_config = None
  if FLAGS.cluster_resolver == "slurm":
    os.environ["TF_CONFIG"] = json.dumps(cluster.tf_config_from_slurm(
        ps_tasks=FLAGS.slurm_ps_tasks, port_base=FLAGS.slurm_port_base))
  if config.strategy in ("multi_worker_mirrored", "parameter_server"):
    tf_config = require_tf_config(
        config.strategy, needs_ps=config.strategy == "parameter_server")
  if config.model_parallel.devices == "cluster":
    from framework.model_parallel import start_cluster  # pylint: disable=g-import-not-at-top
    tf_config = start_cluster(config.model_parallel)
    if tf_config is None:
      return None  # a worker: it served the chief until stopped
  if config.strategy == "parameter_server":
    # Recommended for every task of a parameter-server job: a lost peer
    # surfaces as an error instead of endless gRPC retries.
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    if tf_config["task"]["type"] in ("worker", "ps"):
      cluster.run_server(tf_config)
      return None
  program = os.path.basename(sys.argv[0])
  watchdog = cluster.StartupWatchdog(tf_config, timeout=FLAGS.startup_timeout,
                                     program=program)
  with watchdog:
    if config.strategy == "parameter_server":

      def prepare_ps(controller):
        # The coordinator copes with missing workers, but a missing ps
        # blocks the first loop: the cluster is up once a loop ran.
        controller.on_loop_end.append(lambda step: watchdog.started())
        # SIGTERM to the coordinator: checkpoint at the loop end, exit 42.
        preemption.install(controller)

      try:
        return experiment.run(config, trainer_cls=trainer_cls,
                              prepare_controller=prepare_ps)
      except cluster.PEER_ERRORS as e:
        # Worker failures are retried by the coordinator; what reaches here
        # is fatal (typically a lost ps task, whose variables are gone).
        raise cluster.peer_failure(e, tf_config) from None
    controllers = []

    def prepare(controller):
      # The model's variables exist: under MultiWorkerMirroredStrategy
      # their creation needed every peer, so the cluster is up.
      watchdog.started()
      preemption.install(controller)
      controllers.append(controller)

    try:
      results = experiment.run(config, trainer_cls=trainer_cls,
                               prepare_controller=prepare)
    except cluster.PEER_ERRORS as e:
      if tf_config is None:
        raise
      raise cluster.peer_failure(e, tf_config) from None
    logging.info("final weights sha256=%s",
                 weights_digest(controllers[0].trainer.model))
    return results


def weights_digest(model):
  """A digest of the model's weights (equal digests: identical weights)."""
  import hashlib  # pylint: disable=g-import-not-at-top
  digest = hashlib.sha256()
  for weight in model.weights:
    digest.update(weight.numpy().tobytes())
  return digest.hexdigest()[:16]


def run_main(trainer_cls=None):
  """Runs the app; errors a user can fix end in one line and exit code 1."""
  import framework  # pylint: disable=g-import-not-at-top
  with cli.one_line_errors():
    if FLAGS.cpu_devices:
      # Must happen before TensorFlow creates its devices.
      framework.configure_cpu_devices(FLAGS.cpu_devices)
    config = config_from_flags()
    # No trainer_cls: the dataset's task picks it (see experiment.build).
    results = _run_config(config, trainer_cls)
  if results:
    logging.info("final eval: %s", results)


_CLUSTER_STRATEGIES = ("multi_worker_mirrored", "parameter_server")


def check_tf_config_early():
  """Checks TF_CONFIG before TensorFlow's multi-second import.

  A bad cluster description then fails at once, with one line; the run
  checks it again later. `framework` imports its modules lazily and
  framework.distribute.tf_config needs no TensorFlow, so this imports none.
  """
  if (FLAGS.strategy not in _CLUSTER_STRATEGIES or
      FLAGS.cluster_resolver != "tf_config"):
    return
  from framework.distribute import tf_config  # pylint: disable=g-import-not-at-top
  # A ConfigError becomes one line (main runs this under one_line_errors).
  tf_config.require_tf_config(
      FLAGS.strategy, needs_ps=FLAGS.strategy == "parameter_server")


def _check_and_run():
  check_tf_config_early()
  run_main()


main = cli.main_running(_check_and_run)


def entry():
  """Console entry point `distloop-train`."""
  cli.run_entry_point(main, __name__)


if __name__ == "__main__":
  app.run(main)
