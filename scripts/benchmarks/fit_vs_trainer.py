"""Keras `model.fit` (A) vs the distloop Trainer (B, and C: without fused
updates), and MFU, on the seed CIFAR-10 CNN.

    python scripts/benchmarks/fit_vs_trainer.py --quick \
        --output_json=/tmp/fit_vs_trainer.json

For each of --strategies (`default`, `mirrored` on 2 CPU devices), in its own
process (logical devices are fixed when TensorFlow starts):
  * the same model, global batch, input pipeline (`framework.data.inputs`) and
    optimizer for (A) `model.fit` with `steps_per_execution = steps_per_loop`
    and (B) `Trainer.train` with `steps_per_loop`, and (C) the same Trainer
    with Keras's `update_step` instead of fused optimizer kernels (the
    "before"); after warm-up, rounds alternate A B C A B C and the table
    reports medians of examples/s and of the per-round ratios B / A, C / A;
  * MFU = training FLOPs per example (conv + matmul ops counted in the
    traced graph of a step, equal to the analytic count) x examples/s /
    float32 matmul peak, the peak measured in every round right after A, B
    and C (median over rounds);
  * the op types of the same `steps_per_loop` steps of A and B, from
    TensorFlow's profiler.
Timings are noisy on a shared machine: compare the ratios, not the absolutes.
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

from scripts.benchmarks import common  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_bool("xla", False, "Also jit-compile the Trainer's step (Keras "
                  "fit uses XLA by default when op determinism is off).")


class _FitTimer:
  """Times `fit` from the end of its first execution to the end of its last."""

  def __new__(cls):
    import keras  # pylint: disable=g-import-not-at-top

    class Timer(keras.callbacks.Callback):

      def on_train_begin(self, logs=None):
        self.times = []

      def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter())

    return Timer()


def measure():
  """One process: Keras fit vs Trainer, alternating, plus FLOPs and peak."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework.data import inputs  # pylint: disable=g-import-not-at-top
  from framework.perf import flops, profiling  # pylint: disable=g-import-not-at-top
  framework, strategy, dataset = common.load()
  name, cpu_devices = common.strategy_spec()
  batch, spl, loops = (FLAGS.global_batch_size, FLAGS.steps_per_loop,
                       FLAGS.loops_per_round)
  peak_before = flops.matmul_peak_flops(size=FLAGS.peak_matmul_size)

  # (A) Keras fit: compiled as its docs say, same pipeline, same batches.
  fit_side = common.Setup(strategy, dataset)

  def compile_fit(steps_per_execution):
    with strategy.scope():
      fit_side.model.compile(
          optimizer=fit_side.optimizer,
          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
          metrics=["accuracy"], steps_per_execution=steps_per_execution)
    return steps_per_execution

  fit_spe = compile_fit(spl)
  fit_data = inputs.train_dataset(dataset, batch)
  fit_steps = (loops + 1) * spl  # +1: the first `spl` steps are not timed

  def run_fit():
    timer = _FitTimer()
    fit_side.model.fit(fit_data, epochs=1, steps_per_epoch=fit_steps,
                       verbose=0, callbacks=[timer])
    # One callback per execution of `fit_spe` steps.
    return timer.times[-1] - timer.times[spl // fit_spe - 1]

  # (B) the distloop Trainer.
  trainer_side = common.Setup(strategy, dataset)
  trainer = common.make_trainer(trainer_side, strategy, batch)
  if FLAGS.xla:
    trainer.compute_gradients = tf.function(trainer.compute_gradients,
                                            jit_compile=True)
  iterator = iter(inputs.distribute_train(strategy, dataset, batch))
  # (C) the Trainer before fused updates: Keras's `update_step` per variable.
  unfused_side = common.Setup(strategy, dataset)
  unfused = common.make_trainer(unfused_side, strategy, batch, fused_updates=False)
  unfused_iterator = iter(inputs.distribute_train(strategy, dataset,
                                                     batch))

  # Warm-up: tracing, pipeline start, thread pools.
  fit_note = ""
  try:
    run_fit()
  except tf.errors.InvalidArgumentError:
    # Keras 3 fit with steps_per_execution > 1 fails under MirroredStrategy
    # ("You must feed a value for placeholder", keras-team/keras#19246).
    fit_note = (f"fit steps_per_execution={spl} fails under {name} "
                "(keras-team/keras#19246); fit runs with 1")
    fit_spe = compile_fit(1)
    run_fit()
  common.time_trainer(trainer, iterator, 1, spl)
  common.time_trainer(unfused, unfused_iterator, 1, spl)
  examples = loops * spl * batch
  counted = flops.training_flops_per_example(trainer_side.model,
                                             dataset.input_shape)
  graph = counted["matmul"]
  analytic = flops.analytic_flops_per_example(trainer_side.model)
  # Each round: A, B, C, then the matmul peak, so that every MFU divides by a
  # peak measured under the same machine load (others share these cores).
  fit_rates, trainer_rates, ratios, peaks = [], [], [], [peak_before]
  fit_mfus, trainer_mfus, unfused_ratios = [], [], []
  for _ in range(FLAGS.rounds):
    fit_rate = examples / run_fit()
    trainer_rate = examples / common.time_trainer(trainer, iterator, loops, spl)
    unfused_rate = examples / common.time_trainer(unfused, unfused_iterator, loops,
                                            spl)
    peak = flops.matmul_peak_flops(size=FLAGS.peak_matmul_size, trials=2)
    fit_rates.append(fit_rate)
    trainer_rates.append(trainer_rate)
    ratios.append(trainer_rate / fit_rate)
    unfused_ratios.append(unfused_rate / fit_rate)
    peaks.append(peak)
    fit_mfus.append(graph * fit_rate / peak)
    trainer_mfus.append(graph * trainer_rate / peak)
  # The same `spl` steps of each under TensorFlow's profiler: which op
  # types each side spends its time in (the kernels are the same).
  op_time = {
      "fit": profiling.profile_op_table(lambda: fit_side.model.fit(
          fit_data, epochs=1, steps_per_epoch=spl, verbose=0)),
      "trainer": profiling.profile_op_table(
          lambda: common.time_trainer(trainer, iterator, 1, spl)),
  }
  return {
      "strategy": name, "cpu_devices": cpu_devices,
      "replicas": strategy.num_replicas_in_sync, "global_batch_size": batch,
      "steps_per_loop": spl, "rounds": FLAGS.rounds,
      "fit_jit_compile": bool(fit_side.model.jit_compile),
      "fit_steps_per_execution": fit_spe, "fit_note": fit_note,
      "trainer_xla": FLAGS.xla,
      "fit_examples_per_s": statistics.median(fit_rates),
      "trainer_examples_per_s": statistics.median(trainer_rates),
      "ratio_median": statistics.median(ratios), "ratios": ratios,
      "unfused_ratio_median": statistics.median(unfused_ratios),
      "unfused_ratios": unfused_ratios,
      "flops_per_example_graph": graph,
      "flops_per_example_analytic": analytic["training"],
      "flops_per_example_tf_profiler_all_ops": counted["all"],
      "matmul_peak_flops": statistics.median(peaks), "matmul_peaks": peaks,
      "fit_mfu": statistics.median(fit_mfus),
      "trainer_mfu": statistics.median(trainer_mfus),
      "trainer_mfus": trainer_mfus,
      "op_time": {side: t.as_dict() for side, t in op_time.items()},
  }


def run():
  """Measures every strategy of --strategies, each in its own process."""
  return [common.child(__file__, spec, f"--xla={FLAGS.xla}")
          for spec in FLAGS.strategies]


def _print_op_comparison(r, top=16):
  """Op types of `steps_per_loop` steps of fit and of the Trainer."""
  sides = {side: {name: (ms, count) for name, ms, count in t["rows"]}
           for side, t in r["op_time"].items()}
  names = sorted(set(sides["fit"]) | set(sides["trainer"]),
                 key=lambda n: -max(sides["fit"].get(n, (0, 0))[0],
                                    sides["trainer"].get(n, (0, 0))[0]))
  fit, trainer = r["op_time"]["fit"], r["op_time"]["trainer"]
  print(f"\nop types of {r['steps_per_loop']} steps ({r['strategy']}; "
        "TensorFlow profiler; op times overlap): fit wall "
        f"{fit['wall_ms']:.1f} ms, op time {fit['total_ms']:.1f} ms; Trainer "
        f"wall {trainer['wall_ms']:.1f} ms, op time {trainer['total_ms']:.1f}"
        " ms")
  print(f"  {'op type':<40}{'fit ms':>9}{'count':>7}{'Trainer ms':>12}"
        f"{'count':>7}")
  for name in names[:top]:
    (fit_ms, fit_n), (tr_ms, tr_n) = (sides["fit"].get(name, (0.0, 0)),
                                      sides["trainer"].get(name, (0.0, 0)))
    print(f"  {name:<40}{fit_ms:>9.1f}{fit_n:>7}{tr_ms:>12.1f}{tr_n:>7}")


def report(compare):
  """Prints the A / B / C table, the FLOPs and the op-type comparison."""
  print("\nKeras fit (A) vs distloop Trainer (B; C: with Keras's "
        "update_step instead of fused kernels), seed CIFAR-10 CNN, median "
        "over rounds")
  header = (f"{'strategy':<12}{'batch':>6}{'spl':>5}{'fit ex/s':>10}"
            f"{'distloop':>10}{'B/A':>7}{'C/A':>7}{'fit MFU':>9}{'dl MFU':>8}"
            f"{'peak GF/s':>11}{'MF/ex':>8}")
  print(header)
  print("-" * len(header))
  for r in compare:
    name = r["strategy"] + (f":{r['cpu_devices']}" if r["cpu_devices"]
                            else "")
    print(f"{name:<12}{r['global_batch_size']:>6}{r['steps_per_loop']:>5}"
          f"{r['fit_examples_per_s']:>10.1f}"
          f"{r['trainer_examples_per_s']:>10.1f}{r['ratio_median']:>7.3f}"
          f"{r['unfused_ratio_median']:>7.3f}"
          f"{r['fit_mfu']:>9.3f}{r['trainer_mfu']:>8.3f}"
          f"{r['matmul_peak_flops'] / 1e9:>11.1f}"
          f"{r['flops_per_example_graph'] / 1e6:>8.1f}")
  for r in compare:
    if r["fit_note"]:
      print(f"note ({r['strategy']}): {r['fit_note']}")
  if compare:
    r = compare[0]
    print(f"training FLOPs/example (MFU numerator): conv+matmul counted in "
          f"the traced graph {r['flops_per_example_graph']:.6g}, analytic "
          f"{r['flops_per_example_analytic']:.6g}; TF profiler, all ops: "
          f"{r['flops_per_example_tf_profiler_all_ops']:.6g}")
    print(f"fit jit_compile={r['fit_jit_compile']}, "
          f"trainer XLA={r['trainer_xla']}")
    _print_op_comparison(r)


def main(argv):
  del argv
  common.apply_quick()
  if FLAGS.result_file:
    common.write_json(FLAGS.result_file, measure())
    return
  compare = run()
  report(compare)
  if FLAGS.output_json:
    common.write_json(FLAGS.output_json, {"compare": compare}, indent=2)


if __name__ == "__main__":
  app.run(main)
