"""distloop Trainer vs Keras `model.fit`, and MFU, on the seed CIFAR-10 CNN.

    python scripts/benchmark.py --quick --output_json=/tmp/bench.json

For each strategy (`default`, `mirrored` on 2 CPU devices), in its own
process (logical devices are fixed when TensorFlow starts):
  * the same model, global batch, input pipeline (`framework.inputs`) and
    optimizer for (A) `model.fit` with `steps_per_execution = steps_per_loop`
    and (B) `Trainer.train` with `steps_per_loop`, and (C) the same Trainer
    with Keras's `update_step` instead of fused optimizer kernels (the
    "before"); after warm-up, rounds alternate A B C A B C and the table
    reports medians of examples/s and of the per-round ratios B / A, C / A;
  * MFU = training FLOPs per example (conv + matmul ops counted in the
    traced graph of a step, equal to the analytic count) x examples/s /
    float32 matmul peak, the peak measured in every round right after A and B
    (median over rounds).
Then the Trainer alone with `--mixed_precision` and `--grad_accum_steps`
variants: speed alternating in one process (ratio to float32), memory as the
peak RSS of a process that trains only that variant. Last, a breakdown of a
step's time (input pipeline, forward, backward, the rest).
Timings are noisy on a shared machine: compare the ratios, not the absolutes.
"""

import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "A few minutes: small batch, few rounds.")
flags.DEFINE_list("strategies", ["default", "mirrored:2"], "strategy[:cpu "
                  "devices] to compare, each in its own process.")
flags.DEFINE_integer("global_batch_size", 256, "Examples per step.")
flags.DEFINE_integer("steps_per_loop", 10, "Trainer steps_per_loop = "
                     "fit steps_per_execution.")
flags.DEFINE_integer("loops_per_round", 3, "Timed loops per round.")
flags.DEFINE_integer("rounds", 5, "A B rounds after warm-up.")
flags.DEFINE_string("data_dir", None, "CIFAR-10 directory (default: "
                    "synthetic CIFAR-shaped data; same cost per batch).")
flags.DEFINE_bool("xla", False, "Also jit-compile the Trainer's step (Keras "
                  "fit uses XLA by default when op determinism is off).")
flags.DEFINE_list("variants", ["float32", "bfloat16", "float16",
                               "float32/accum2", "float32/accum4"],
                  "Trainer-only variants: precision[/accumK].")
flags.DEFINE_bool("breakdown", True, "Also time the stages of a step "
                  "(input, forward, backward, full step).")
flags.DEFINE_integer("memory_batch_size", 1024, "Global batch for the "
                     "variants' memory measurement (large, so that "
                     "activations, not TensorFlow itself, dominate).")
flags.DEFINE_string("output_json", None, "Write all figures here.")
# Internal: one measurement process.
flags.DEFINE_enum("role", "main", ["main", "compare", "variant",
                                   "variants_speed", "breakdown"],
                  "Internal.")
flags.DEFINE_string("strategy", "default", "Internal: this process's strategy.")
flags.DEFINE_integer("cpu_devices", None, "Internal: logical CPU devices.")
flags.DEFINE_string("variant", "float32", "Internal: this process's variant.")
flags.DEFINE_string("result_file", None, "Internal: where to write results.")


def _rss_mb():
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def _peak_rss_mb():
  # VmHWM: this process's peak (ru_maxrss survives exec, so it can be the
  # parent's).
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024
  return float("nan")


class _Setup:
  """Model, optimizer and pipeline for one side of the comparison."""

  def __init__(self, strategy, dataset, precision="float32",
               grad_accum_steps=1):
    import keras  # pylint: disable=g-import-not-at-top
    import models  # pylint: disable=g-import-not-at-top
    from framework import precision as precision_lib  # pylint: disable=g-import-not-at-top
    keras.utils.set_random_seed(0)
    precision_lib.set_precision(precision)
    try:
      with strategy.scope():
        self.model = models.build_model("cifar_cnn", dataset.input_shape,
                                        dataset.num_classes)
        self.optimizer = keras.optimizers.Adam(1e-3)
    finally:
      precision_lib.set_precision("float32")
    self.loss_scale = (precision_lib.LossScale(strategy)
                       if precision_lib.needs_loss_scale(precision) else None)
    self.grad_accum_steps = grad_accum_steps


def _time_trainer(trainer, iterator, loops, steps_per_loop):
  start = time.perf_counter()
  for _ in range(loops):
    float(trainer.train(iterator, steps_per_loop)["loss"])  # as the controller
  return time.perf_counter() - start


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


def _make_trainer(setup, strategy, global_batch_size, fused_updates=True):
  import framework  # pylint: disable=g-import-not-at-top
  return framework.Trainer(setup.model, setup.optimizer, strategy,
                           global_batch_size=global_batch_size,
                           grad_accum_steps=setup.grad_accum_steps,
                           loss_scale=setup.loss_scale,
                           fused_updates=fused_updates)


def _load(strategy_name, cpu_devices):
  import framework  # pylint: disable=g-import-not-at-top
  if cpu_devices:
    framework.configure_cpu_devices(cpu_devices)
  strategy = framework.make_strategy(strategy_name)
  if FLAGS.data_dir:
    dataset = framework.load_cifar10(FLAGS.data_dir)
  else:
    dataset = framework.synthetic(num_train=8192, num_test=16)
  return framework, strategy, dataset


def compare_main():
  """One process: Keras fit vs Trainer, alternating, plus FLOPs and peak."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework import flops, profiling  # pylint: disable=g-import-not-at-top
  framework, strategy, dataset = _load(FLAGS.strategy, FLAGS.cpu_devices)
  batch, spl, loops = (FLAGS.global_batch_size, FLAGS.steps_per_loop,
                       FLAGS.loops_per_round)
  peak_before = flops.matmul_peak_flops()

  # (A) Keras fit: compiled as its docs say, same pipeline, same batches.
  fit_side = _Setup(strategy, dataset)

  def compile_fit(steps_per_execution):
    with strategy.scope():
      fit_side.model.compile(
          optimizer=fit_side.optimizer,
          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
          metrics=["accuracy"], steps_per_execution=steps_per_execution)
    return steps_per_execution

  fit_spe = compile_fit(spl)
  fit_data = framework.train_dataset(dataset, batch)
  fit_steps = (loops + 1) * spl  # +1: the first `spl` steps are not timed

  def run_fit():
    timer = _FitTimer()
    fit_side.model.fit(fit_data, epochs=1, steps_per_epoch=fit_steps,
                       verbose=0, callbacks=[timer])
    # One callback per execution of `fit_spe` steps.
    return timer.times[-1] - timer.times[spl // fit_spe - 1]

  # (B) the distloop Trainer.
  trainer_side = _Setup(strategy, dataset)
  trainer = _make_trainer(trainer_side, strategy, batch)
  if FLAGS.xla:
    trainer.compute_gradients = tf.function(trainer.compute_gradients,
                                            jit_compile=True)
  iterator = iter(framework.distribute_train(strategy, dataset, batch))
  # (C) the Trainer before fused updates: Keras's `update_step` per variable.
  unfused_side = _Setup(strategy, dataset)
  unfused = _make_trainer(unfused_side, strategy, batch, fused_updates=False)
  unfused_iterator = iter(framework.distribute_train(strategy, dataset,
                                                     batch))

  # Warm-up: tracing, pipeline start, thread pools.
  fit_note = ""
  try:
    run_fit()
  except tf.errors.InvalidArgumentError:
    # Keras 3 fit with steps_per_execution > 1 fails under MirroredStrategy
    # ("You must feed a value for placeholder", keras-team/keras#19246).
    fit_note = (f"fit steps_per_execution={spl} fails under {FLAGS.strategy} "
                "(keras-team/keras#19246); fit runs with 1")
    fit_spe = compile_fit(1)
    run_fit()
  _time_trainer(trainer, iterator, 1, spl)
  _time_trainer(unfused, unfused_iterator, 1, spl)
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
    trainer_rate = examples / _time_trainer(trainer, iterator, loops, spl)
    unfused_rate = examples / _time_trainer(unfused, unfused_iterator, loops,
                                            spl)
    peak = flops.matmul_peak_flops(trials=2)
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
          lambda: _time_trainer(trainer, iterator, 1, spl)),
  }
  return {
      "strategy": FLAGS.strategy, "cpu_devices": FLAGS.cpu_devices,
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


def _variant_trainer(framework, strategy, dataset, variant):
  precision, _, accum = variant.partition("/accum")
  batch = FLAGS.global_batch_size
  setup = _Setup(strategy, dataset, precision, int(accum or 1))
  trainer = _make_trainer(setup, strategy, batch)
  return trainer, iter(framework.distribute_train(strategy, dataset, batch))


def variant_main():
  """One process per variant: its memory (peak RSS while training)."""
  framework, strategy, dataset = _load(FLAGS.strategy, FLAGS.cpu_devices)
  FLAGS.global_batch_size = FLAGS.memory_batch_size  # activations dominate
  trainer, iterator = _variant_trainer(framework, strategy, dataset,
                                       FLAGS.variant)
  rss_before = _rss_mb()
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM: the data loading peak is not training's
  _time_trainer(trainer, iterator, 2, 1)
  return {"variant": FLAGS.variant, "peak_rss_mb": _peak_rss_mb(),
          "train_rss_growth_mb": _peak_rss_mb() - rss_before}


def variants_speed_main():
  """One process: all variants' speed, alternating rounds (ratios to the first)."""
  framework, strategy, dataset = _load(FLAGS.strategy, FLAGS.cpu_devices)
  runs = [_variant_trainer(framework, strategy, dataset, v)
          for v in FLAGS.variants]
  spl, loops = FLAGS.steps_per_loop, FLAGS.loops_per_round
  examples = loops * spl * FLAGS.global_batch_size
  for trainer, iterator in runs:
    _time_trainer(trainer, iterator, 1, spl)  # warm-up
  rates = [[] for _ in runs]
  for _ in range(FLAGS.rounds):
    for rate, (trainer, iterator) in zip(rates, runs):
      rate.append(examples / _time_trainer(trainer, iterator, loops, spl))
  return [{"variant": v, "strategy": FLAGS.strategy,
           "examples_per_s": statistics.median(r),
           "ratio_to_first": statistics.median(
               [a / b for a, b in zip(r, rates[0])])}
          for v, r in zip(FLAGS.variants, rates)]


def breakdown_main():
  """One process: where a Trainer step's time goes, stage by stage."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework import flops, profiling  # pylint: disable=g-import-not-at-top
  framework, strategy, dataset = _load(FLAGS.strategy, FLAGS.cpu_devices)
  batch, spl = FLAGS.global_batch_size, FLAGS.steps_per_loop
  setup = _Setup(strategy, dataset)
  trainer = _make_trainer(setup, strategy, batch)
  model, variables = setup.model, setup.model.trainable_variables
  images, labels = next(iter(framework.train_dataset(dataset, batch)))
  source = framework.train_dataset(dataset, batch)

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
  dist_iterator = iter(framework.distribute_train(strategy, dataset, batch))
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
    peaks.append(flops.matmul_peak_flops(trials=2))
  ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
  per_example = flops.training_flops_per_example(
      model, dataset.input_shape)["matmul"]
  # Each conv/dense layer's kernels alone, with the peak measured around
  # them: unless kernels overlap, no loop can make a step faster than their
  # sum.
  layers = flops.layer_kernel_times(model, batch)
  peaks.append(flops.matmul_peak_flops(trials=2))
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
  return {"strategy": FLAGS.strategy, "global_batch_size": batch,
          "ms_per_step": ms, "matmul_peak_flops": peak,
          "kernel_mfu": per_example * batch / (ms["+ backward"] / 1000) / peak,
          "trainer_mfu": (per_example * batch
                          / (ms["full Trainer step"] / 1000) / peak),
          "loop_ceiling": ms["full Trainer step"] / ms["+ backward"],
          "layers": layers, "layers_ms": layers_ms,
          "layer_kernels_mfu": (sum(row["flops"] for row in layers)
                                / (layers_ms / 1000) / peak),
          "op_time": table.as_dict(top=12)}


def _child(role, strategy_spec, variant=None):
  """Runs one measurement process; returns its result dict."""
  name, _, devices = strategy_spec.partition(":")
  result_file = os.path.join("/tmp", f"distloop_bench_{os.getpid()}_"
                             f"{time.time_ns()}.json")
  args = [sys.executable, os.path.abspath(__file__), f"--role={role}",
          f"--strategy={name}", f"--result_file={result_file}",
          f"--global_batch_size={FLAGS.global_batch_size}",
          f"--steps_per_loop={FLAGS.steps_per_loop}",
          f"--loops_per_round={FLAGS.loops_per_round}",
          f"--rounds={FLAGS.rounds}", f"--xla={FLAGS.xla}",
          f"--variants={','.join(FLAGS.variants)}",
          f"--memory_batch_size={FLAGS.memory_batch_size}"]
  if devices:
    args.append(f"--cpu_devices={devices}")
  if FLAGS.data_dir:
    args.append(f"--data_dir={FLAGS.data_dir}")
  if variant:
    args.append(f"--variant={variant}")
  proc = subprocess.run(args, capture_output=True, text=True)
  if proc.returncode != 0:
    sys.exit(f"benchmark.py: error: {role} {strategy_spec} {variant or ''} "
             f"failed:\n{proc.stderr[-3000:]}")
  with open(result_file) as f:
    result = json.load(f)
  os.remove(result_file)
  return result


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


def _print_tables(compare, variants, breakdown):
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
  if variants:
    print("\ndistloop Trainer variants: speed alternating in one process "
          "(median ratio to the first);\nmemory: peak RSS of a process "
          "training only that variant at global batch "
          f"{FLAGS.memory_batch_size}, and its growth while training")
    header = (f"{'variant':<18}{'ex/s':>9}{'vs first':>10}{'peak RSS MB':>13}"
              f"{'train growth MB':>17}")
    print(header)
    print("-" * len(header))
    for r in variants:
      print(f"{r['variant']:<18}{r['examples_per_s']:>9.1f}"
            f"{r['ratio_to_first']:>10.3f}"
            f"{r['peak_rss_mb']:>13.0f}{r['train_rss_growth_mb']:>17.0f}")
  if breakdown:
    print(f"\nwhere a step's time goes ({breakdown['strategy']}, batch "
          f"{breakdown['global_batch_size']}), ms per step")
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


def main(argv):
  del argv
  if FLAGS.role != "main":
    result = {"compare": compare_main, "variant": variant_main,
              "variants_speed": variants_speed_main,
              "breakdown": breakdown_main}[FLAGS.role]()
    with open(FLAGS.result_file, "w") as f:
      json.dump(result, f)
    return
  if FLAGS.quick:
    for name, value in (("global_batch_size", 128), ("steps_per_loop", 5),
                        ("loops_per_round", 2), ("rounds", 3)):
      if not FLAGS[name].present:
        FLAGS[name].value = value
  compare = [_child("compare", spec) for spec in FLAGS.strategies]
  variants = _child("variants_speed", FLAGS.strategies[0])
  for row in variants:
    row.update(_child("variant", FLAGS.strategies[0], row["variant"]))
  breakdown = (_child("breakdown", FLAGS.strategies[0]) if FLAGS.breakdown
               else None)
  _print_tables(compare, variants, breakdown)
  if FLAGS.output_json:
    with open(FLAGS.output_json, "w") as f:
      json.dump({"compare": compare, "variants": variants,
                 "breakdown": breakdown,
                 "flags": {k: FLAGS[k].value for k in (
                     "quick", "global_batch_size", "steps_per_loop",
                     "memory_batch_size",
                     "loops_per_round", "rounds", "xla", "data_dir")}},
                f, indent=2)


if __name__ == "__main__":
  app.run(main)
