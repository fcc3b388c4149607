"""What the CIFAR-10 CNN benchmarks share: flags, setup, timing, processes.

`fit_vs_trainer.py`, `variants.py` and `breakdown.py` measure in child
processes of their own (logical devices are fixed when TensorFlow starts, and
a peak RSS is a whole process's): run without `--result_file`, a benchmark
starts itself with `--result_file=...` once per measurement and prints what
the children wrote there. `suite.py` runs all three the same way.
"""

import json
import os
import subprocess
import sys
import time

from absl import flags

from framework.app.config import ExperimentConfig
from framework.core.config import TrainerConfig
from framework.settings import default
from scripts.benchmarks import matmul_peak  # pylint: disable=unused-import  (--peak_matmul_size)

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "A few minutes: small batch, few rounds.")
flags.DEFINE_list("strategies", ["default", "mirrored:2"], "strategy[:cpu "
                  "devices] to compare, each in its own process; "
                  "variants.py and breakdown.py measure the first.")
flags.DEFINE_integer("global_batch_size", 256, "Examples per step.")
flags.DEFINE_integer("steps_per_loop", 10, "Trainer steps_per_loop = "
                     "fit steps_per_execution.")
flags.DEFINE_integer("loops_per_round", 3, "Timed loops per round.")
flags.DEFINE_integer("rounds", 5, "Alternating rounds after warm-up.")
flags.DEFINE_string("data_dir", None, "CIFAR-10 directory (default: "
                    "synthetic CIFAR-shaped data; same cost per batch).")
flags.DEFINE_enum("recipe", "reference", ["reference", "fast"], "The "
                  "training step measured: reference (Adam, plain "
                  "cross-entropy, no augmentation) or fast (the step of "
                  "scripts/configs/cifar10_fast.cfg, read from it: its "
                  "optimizer, label smoothing, EMA and augmentation).")
flags.DEFINE_string("output_json", None, "Write all figures here.")
flags.DEFINE_string("result_file", None, "Internal: measure in this process "
                    "(the first of --strategies) and write the result here.")

_QUICK = (("global_batch_size", 128), ("steps_per_loop", 5),
          ("loops_per_round", 2), ("rounds", 3))
# Forwarded to every measurement process.
_SHARED = ("global_batch_size", "steps_per_loop", "loops_per_round", "rounds",
           "recipe", "peak_matmul_size")


def apply_quick():
  """--quick: smaller defaults for the flags not given explicitly."""
  if FLAGS.quick:
    for name, value in _QUICK:
      if not FLAGS[name].present:
        FLAGS[name].value = value


def write_json(path, value, indent=None):
  with open(path, "w") as f:
    json.dump(value, f, indent=indent)


def child(script, strategy_spec, *args):
  """Runs `script` as one measurement process; returns its result."""
  result_file = os.path.join("/tmp", f"distloop_bench_{os.getpid()}_"
                             f"{time.time_ns()}.json")
  command = [sys.executable, os.path.abspath(script),
             f"--result_file={result_file}", f"--strategies={strategy_spec}",
             *(f"--{name}={FLAGS[name].value}" for name in _SHARED), *args]
  if FLAGS.data_dir:
    command.append(f"--data_dir={FLAGS.data_dir}")
  proc = subprocess.run(command, capture_output=True, text=True)
  if proc.returncode != 0:
    sys.exit(f"{os.path.basename(script)}: error: {strategy_spec} "
             f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
  with open(result_file) as f:
    result = json.load(f)
  os.remove(result_file)
  return result


def strategy_spec():
  """(name, logical CPU devices or None) of this measurement process."""
  name, _, cpu_devices = FLAGS.strategies[0].partition(":")
  return name, int(cpu_devices) if cpu_devices else None


def load():
  """This measurement process's framework, strategy and dataset."""
  import framework  # pylint: disable=g-import-not-at-top
  from framework.data import datasets  # pylint: disable=g-import-not-at-top
  name, cpu_devices = strategy_spec()
  if cpu_devices:
    framework.configure_cpu_devices(cpu_devices)
  strategy = framework.make_strategy(name)
  if FLAGS.data_dir:
    dataset = datasets.load_cifar10(FLAGS.data_dir)
  else:
    dataset = datasets.synthetic(num_train=8192, num_test=16)
  return framework, strategy, dataset


class Setup:
  """Model, optimizer and pipeline for one side of a comparison."""

  def __init__(self, strategy, dataset,
               precision=default(ExperimentConfig, "mixed_precision"),
               grad_accum_steps=default(TrainerConfig, "grad_accum_steps")):
    import keras  # pylint: disable=g-import-not-at-top
    import models  # pylint: disable=g-import-not-at-top
    from framework.core import precision as precision_lib  # pylint: disable=g-import-not-at-top
    keras.utils.set_random_seed(0)
    precision_lib.set_precision(precision)
    try:
      with strategy.scope():
        self.model = models.build_model("cifar_cnn", dataset.input_shape,
                                        dataset.num_classes)
        self.optimizer = _optimizer()
    finally:
      precision_lib.set_precision("float32")
    self.loss_scale = (precision_lib.LossScale(strategy)
                       if precision_lib.needs_loss_scale(precision) else None)
    self.grad_accum_steps = grad_accum_steps


FAST_RECIPE = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "cifar10_fast.cfg")


def _fast_recipe():
  """{flag: value} of scripts/configs/cifar10_fast.cfg, read from the file
  so that the measured step stays the recipe's."""
  values = {}
  with open(FAST_RECIPE) as f:
    for line in f:
      line = line.strip()
      if line.startswith("--"):
        name, _, value = line[2:].partition("=")
        values[name] = value or "true"
  return values


def recipe_precision():
  """The compute dtype of the step measured: the fast recipe's
  --mixed_precision (auto: what it resolves to here), else float32."""
  if FLAGS.recipe == "reference":
    return "float32"
  from framework.core import precision as precision_lib  # pylint: disable=g-import-not-at-top
  return precision_lib.resolve_precision(
      _fast_recipe().get("mixed_precision",
                         default(ExperimentConfig, "mixed_precision")))


def _optimizer():
  import keras  # pylint: disable=g-import-not-at-top
  if FLAGS.recipe == "reference":
    return keras.optimizers.Adam(1e-3)
  from framework.core import optimizers  # pylint: disable=g-import-not-at-top
  recipe = _fast_recipe()
  # The schedule's length (a guess of 15 epochs of 97 steps) does not change
  # a step's cost.
  config = optimizers.OptimizerConfig(
      name=recipe["optimizer"], learning_rate=float(recipe["learning_rate"]),
      momentum=float(recipe["momentum"]), nesterov="nesterov" in recipe,
      schedule=recipe["lr_schedule"], total_steps=1455,
      lr_scaling=recipe["lr_scaling"],
      base_batch_size=int(recipe["lr_base_batch_size"]))
  return optimizers.make_optimizer(config.scaled(FLAGS.global_batch_size))


def augmentation():
  """The recipe's training augmentation (None: none)."""
  from framework.data import preprocessing  # pylint: disable=g-import-not-at-top
  return preprocessing.get_augmentation(
      _fast_recipe()["augment"] if FLAGS.recipe == "fast" else "none")


def make_trainer(setup, strategy, global_batch_size, fused_updates=True):
  import framework  # pylint: disable=g-import-not-at-top
  from framework.core.trainer import smoothed_sparse_categorical_loss  # pylint: disable=g-import-not-at-top
  extra = {}
  if FLAGS.recipe == "fast":
    recipe = _fast_recipe()
    extra = dict(loss_fn=smoothed_sparse_categorical_loss(
        float(recipe["label_smoothing"])),
                 ema_decay=float(recipe["ema_decay"]),
                 ema_warmup="ema_warmup" in recipe)
  return framework.Trainer(setup.model, setup.optimizer, strategy,
                           global_batch_size=global_batch_size,
                           grad_accum_steps=setup.grad_accum_steps,
                           loss_scale=setup.loss_scale,
                           fused_updates=fused_updates, **extra)


def time_trainer(trainer, iterator, loops, steps_per_loop):
  start = time.perf_counter()
  for _ in range(loops):
    float(trainer.train(iterator, steps_per_loop)["loss"])  # as the controller
  return time.perf_counter() - start
