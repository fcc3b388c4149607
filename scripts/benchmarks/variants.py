"""The distloop Trainer with `--mixed_precision` and `--grad_accum_steps`
variants, on the seed CIFAR-10 CNN: speed and training memory.

    python scripts/benchmarks/variants.py --quick \
        --variants=float32,bfloat16,float32/accum4

Speed: all variants in one process, alternating rounds (ratio to the first).
Memory: the peak RSS of a process that trains only that variant at
--memory_batch_size, and its growth while training. Both on the first of
--strategies. Timings are noisy on a shared machine: compare the ratios.
"""

import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

from scripts.benchmarks import common  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_list("variants", ["float32", "bfloat16", "float16",
                               "float32/accum2", "float32/accum4"],
                  "Trainer-only variants: precision[/accumK].")
flags.DEFINE_integer("memory_batch_size", 1024, "Global batch for the "
                     "variants' memory measurement (large, so that "
                     "activations, not TensorFlow itself, dominate).")
flags.DEFINE_string("variant", None, "Internal: with --result_file, measure "
                    "this variant's memory (without it: every variant's "
                    "speed).")


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


def _variant_trainer(framework, strategy, dataset, variant):
  precision, _, accum = variant.partition("/accum")
  batch = FLAGS.global_batch_size
  setup = common.Setup(strategy, dataset, precision, int(accum or 1))
  trainer = common.make_trainer(setup, strategy, batch)
  from framework.data import inputs  # pylint: disable=g-import-not-at-top
  return trainer, iter(inputs.distribute_train(strategy, dataset, batch))


def measure_memory():
  """One process per variant: its memory (peak RSS while training)."""
  framework, strategy, dataset = common.load()
  FLAGS.global_batch_size = FLAGS.memory_batch_size  # activations dominate
  trainer, iterator = _variant_trainer(framework, strategy, dataset,
                                       FLAGS.variant)
  rss_before = _rss_mb()
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM: the data loading peak is not training's
  common.time_trainer(trainer, iterator, 2, 1)
  return {"variant": FLAGS.variant, "peak_rss_mb": _peak_rss_mb(),
          "train_rss_growth_mb": _peak_rss_mb() - rss_before}


def measure_speed():
  """One process: all variants' speed, alternating rounds (ratios to the first)."""
  framework, strategy, dataset = common.load()
  runs = [_variant_trainer(framework, strategy, dataset, v)
          for v in FLAGS.variants]
  spl, loops = FLAGS.steps_per_loop, FLAGS.loops_per_round
  examples = loops * spl * FLAGS.global_batch_size
  for trainer, iterator in runs:
    common.time_trainer(trainer, iterator, 1, spl)  # warm-up
  rates = [[] for _ in runs]
  for _ in range(FLAGS.rounds):
    for rate, (trainer, iterator) in zip(rates, runs):
      rate.append(examples / common.time_trainer(trainer, iterator, loops,
                                                 spl))
  return [{"variant": v, "strategy": common.strategy_spec()[0],
           "examples_per_s": statistics.median(r),
           "ratio_to_first": statistics.median(
               [a / b for a, b in zip(r, rates[0])])}
          for v, r in zip(FLAGS.variants, rates)]


def run():
  """Speed in one process, then each variant's memory in its own process."""
  spec = FLAGS.strategies[0]
  variants = f"--variants={','.join(FLAGS.variants)}"
  memory_batch = f"--memory_batch_size={FLAGS.memory_batch_size}"
  rows = common.child(__file__, spec, variants)
  for row in rows:
    row.update(common.child(__file__, spec, variants, memory_batch,
                            f"--variant={row['variant']}"))
  return rows


def report(variants):
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


def main(argv):
  del argv
  common.apply_quick()
  if FLAGS.result_file:
    common.write_json(FLAGS.result_file, measure_memory() if FLAGS.variant
                      else measure_speed())
    return
  variants = run()
  report(variants)
  if FLAGS.output_json:
    common.write_json(FLAGS.output_json, {"variants": variants}, indent=2)


if __name__ == "__main__":
  app.run(main)
