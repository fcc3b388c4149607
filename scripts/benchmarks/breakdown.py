"""Where a distloop Trainer step's time goes, and the MFU ceiling, on the
seed CIFAR-10 CNN.

    python scripts/benchmarks/breakdown.py --quick --strategies=default \
        --output_json=/tmp/breakdown.json
    # the step of scripts/configs/cifar10_fast.cfg (issue 14: >= 97 % in
    # the model's kernels, input < 1 %):
    python scripts/benchmarks/breakdown.py --recipe=fast --strategies=default \
        --global_batch_size=512 --steps_per_loop=10

In one process on the first of --strategies: each stage of a step (input
pipeline, forward + loss, + backward, the full Trainer step) timed as its own
`tf.function` loop; every conv/dense layer's forward + backward kernels timed
alone (no loop can make a step faster than their sum, unless kernels
overlap); the op types of the full step from TensorFlow's profiler.
"""

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

from framework.app.config import ExperimentConfig  # pylint: disable=g-import-not-at-top
from framework.settings import default  # pylint: disable=g-import-not-at-top
from scripts.benchmarks import common  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS


def measure():
  """One process: where a Trainer step's time goes, stage by stage."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework.data import inputs  # pylint: disable=g-import-not-at-top
  from framework.perf import flops, profiling  # pylint: disable=g-import-not-at-top
  framework, strategy, dataset = common.load()
  batch, spl = FLAGS.global_batch_size, FLAGS.steps_per_loop
  precision = common.recipe_precision()
  setup = common.Setup(strategy, dataset, precision=precision)
  trainer = common.make_trainer(setup, strategy, batch)
  model, variables = setup.model, setup.model.trainable_variables
  augment = common.augmentation()
  images, labels = next(iter(inputs.train_dataset(dataset, batch,
                                                     augment=augment)))
  source = inputs.train_dataset(dataset, batch, augment=augment)

  @tf.function
  def input_only(iterator, n):
    total = tf.constant(0.0)
    for _ in tf.range(n):
      x, _ = next(iterator)
      total += x[0, 0, 0, 0]
    return total

  @tf.function
  def forward(n):
    total = tf.constant(0.0)
    for _ in tf.range(n):
      total += trainer.average(trainer.loss_fn(labels, model(images,
                                                             training=True)))
    return total

  @tf.function
  def forward_backward(n):
    total = tf.constant(0.0)
    for _ in tf.range(n):
      with tf.GradientTape() as tape:
        loss = trainer.average(trainer.loss_fn(labels, model(images,
                                                             training=True)))
      total += tf.linalg.global_norm(tape.gradient(loss, variables))
    return total

  iterator = iter(source)
  dist_iterator = iter(inputs.distribute_train(strategy, dataset, batch,
                                                  augment=augment))
  stages = {
      "input pipeline": lambda: input_only(iterator, spl),
      "forward + loss": lambda: forward(spl),
      "+ backward": lambda: forward_backward(spl),
      "full Trainer step": lambda: trainer.train(dist_iterator, spl)["loss"],
  }
  for run in stages.values():
    float(run())  # trace and warm up
  times = {name: [] for name in stages}
  peaks = []
  for _ in range(max(2, FLAGS.rounds)):
    for name, run in stages.items():
      start = time.perf_counter()
      float(run())
      times[name].append((time.perf_counter() - start) / spl)
    peaks.append(flops.matmul_peak_flops(
        size=FLAGS.peak_matmul_size, trials=2))
  ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
  per_example = flops.training_flops_per_example(
      model, dataset.input_shape)["matmul"]
  # Each conv/dense layer's kernels alone, with the peak measured around
  # them: unless kernels overlap, no loop can make a step faster than their
  # sum.
  layers = flops.layer_kernel_times(model, batch)
  peaks.append(flops.matmul_peak_flops(size=FLAGS.peak_matmul_size,
                                       trials=2))
  peak = statistics.median(peaks)
  for row in layers:
    row["fraction_of_peak"] = row["flops"] / (row["ms"] / 1000) / peak
  layers_ms = sum(row["ms"] for row in layers)
  # The op types of the full step, from TensorFlow's profiler.
  table = profiling.profile_op_table(
      lambda: float(trainer.train(dist_iterator, spl)["loss"]))
  # Ceilings no training loop can pass: forward + backward run at most at
  # `kernel_mfu`, and a loop whose all-reduce, clip, update and metrics cost
  # nothing would be `loop_ceiling` times as fast as this Trainer step.
  return {"strategy": common.strategy_spec()[0], "global_batch_size": batch,
          "recipe": FLAGS.recipe, "precision": precision,
          "ms_per_step": ms, "matmul_peak_flops": peak,
          "kernel_mfu": per_example * batch / (ms["+ backward"] / 1000) / peak,
          "trainer_mfu": (per_example * batch
                          / (ms["full Trainer step"] / 1000) / peak),
          "loop_ceiling": ms["full Trainer step"] / ms["+ backward"],
          "layers": layers, "layers_ms": layers_ms,
          "layer_kernels_mfu": (sum(row["flops"] for row in layers)
                                / (layers_ms / 1000) / peak),
          "op_time": table.as_dict(top=12),
          # The model's own ops (forward and backward: every op under its
          # name scope, dropout and BatchNorm included) against the rest of
          # the step (loss, all-reduce, clip, update, EMA, metrics, input).
          "model_op_share": table.share(lambda name: model.name in name),
          "other_ops": sorted(((name, ms) for name, ms in table.names
                               if model.name not in name),
                              key=lambda row: -row[1])[:10]}


def run():
  """Measures in a process of its own (its logical devices, a fresh peak)."""
  return common.child(__file__, FLAGS.strategies[0])


# A record without one measured the default compute dtype.
PRECISION = default(ExperimentConfig, "mixed_precision")


def report(breakdown):
  """Prints the stages, the layers' kernels and the op types of a step."""
  print(f"\nwhere a step's time goes ({breakdown['strategy']}, batch "
        f"{breakdown['global_batch_size']}, recipe "
        f"{breakdown.get('recipe', 'reference')}, "
        f"{breakdown.get('precision', PRECISION)}), ms per step")
  full = breakdown["ms_per_step"]["full Trainer step"]
  for name, ms in breakdown["ms_per_step"].items():
    print(f"  {name:<20}{ms:>9.1f}{100 * ms / full:>7.1f}%")
  print(f"  forward + backward kernels alone: MFU {breakdown['kernel_mfu']:.3f}"
        f" (the Trainer step: {breakdown['trainer_mfu']:.3f}); a loop "
        f"costing nothing beyond them: {breakdown['loop_ceiling']:.3f}x "
        "this Trainer")
  print(f"\nevery conv/dense layer's forward + backward kernels, each "
        f"timed alone at batch {breakdown['global_batch_size']} (nothing "
        "else runs)")
  header = (f"  {'layer':<12}{'input':>20}{'dx':>4}{'GFLOP':>8}{'ms':>8}"
            f"{'of peak':>9}")
  print(header)
  for row in breakdown["layers"]:
    print(f"  {row['layer']:<12}{str(tuple(row['input_shape'])):>20}"
          f"{'y' if row['input_gradient'] else 'n':>4}"
          f"{row['flops'] / 1e9:>8.2f}{row['ms']:>8.1f}"
          f"{row['fraction_of_peak']:>9.3f}")
  print(f"  sum: {breakdown['layers_ms']:.1f} ms = "
        f"{100 * breakdown['layers_ms'] / full:.1f}% of the full step; MFU "
        f"if every other op were free: {breakdown['layer_kernels_mfu']:.3f}"
        " (the ceiling for any loop on these kernels)")
  op_time = breakdown["op_time"]
  print(f"\nop types of {FLAGS.steps_per_loop} full Trainer steps "
        f"(TensorFlow profiler; wall {op_time['wall_ms']:.1f} ms, op time "
        f"{op_time['total_ms']:.1f} ms: parallel ops overlap)")
  for name, ms, count in op_time["rows"]:
    print(f"  {name:<42}{ms:>9.1f} ms{100 * ms / op_time['total_ms']:>7.1f}%"
          f"{count:>7}")
  if "model_op_share" in breakdown:
    share = breakdown["model_op_share"]
    print(f"\nthe model's own ops (forward + backward, under its name "
          f"scope): {100 * share:.1f}% of the op time; everything else "
          f"{100 * (1 - share):.1f}%, most of it in:")
    for name, ms in breakdown["other_ops"]:
      print(f"  {name[-60:]:<60}{ms:>9.1f} ms")


def main(argv):
  del argv
  common.apply_quick()
  if FLAGS.result_file:
    common.write_json(FLAGS.result_file, measure())
    return
  breakdown = run()
  report(breakdown)
  if FLAGS.output_json:
    common.write_json(FLAGS.output_json, {"breakdown": breakdown}, indent=2)


if __name__ == "__main__":
  app.run(main)
