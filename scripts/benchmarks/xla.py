"""The distloop Trainer with and without `jit_compile` (XLA): examples/s.

    python scripts/benchmarks/xla.py --quick --strategies=default,mirrored:2

Each strategy in its own process; in it, for each of --models, a plain and
an XLA trainer from the same initial weights, timed in alternating rounds
(the ratio XLA / plain is per round, then the median). The seed CIFAR-10 CNN
on CIFAR-shaped synthetic data (or --data_dir), the U-Net on the generated
shapes at --unet_image_size. Timings are noisy on a shared machine: compare
the ratios, and note the load average printed with them.
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
flags.DEFINE_list("models", ["cifar_cnn", "unet"], "cifar_cnn and/or unet.")
flags.DEFINE_integer("unet_image_size", 64, "U-Net: image side.")
flags.DEFINE_integer("unet_batch_size", 16, "U-Net: global batch.")


def _trainer(strategy, dataset, model_name, jit_compile, batch):
  import keras  # pylint: disable=g-import-not-at-top
  import framework  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from framework.app import factory  # pylint: disable=g-import-not-at-top
  from framework.data import inputs  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  options = {"depth": 3, "width": 16} if model_name == "unet" else {}
  with strategy.scope():
    model = models.build_model(model_name, dataset.input_shape,
                               dataset.num_classes, **options)
    optimizer = keras.optimizers.Adam(1e-3)
  trainer_cls = factory.default_trainer_cls(dataset)
  trainer = trainer_cls(model, optimizer, strategy, global_batch_size=batch,
                        jit_compile=jit_compile)
  del framework
  return trainer, iter(inputs.distribute_train(strategy, dataset, batch))


def measure():
  """This process's strategy: [{model, plain ex/s, xla ex/s, ratio}]."""
  framework, strategy, cifar = common.load()
  del framework
  rows = []
  for model_name in FLAGS.models:
    if model_name == "unet":
      from framework.data import segmentation_data  # pylint: disable=g-import-not-at-top
      dataset = segmentation_data.shapes(num_train=256, num_test=16,
                                         image_size=FLAGS.unet_image_size)
      batch = FLAGS.unet_batch_size
    else:
      dataset, batch = cifar, FLAGS.global_batch_size
    runs = [_trainer(strategy, dataset, model_name, jit, batch)
            for jit in (False, True)]
    spl, loops = FLAGS.steps_per_loop, FLAGS.loops_per_round
    examples = loops * spl * batch
    for trainer, iterator in runs:
      common.time_trainer(trainer, iterator, 1, spl)  # warm-up (XLA compiles)
    rates = [[], []]
    for _ in range(FLAGS.rounds):
      for rate, (trainer, iterator) in zip(rates, runs):
        rate.append(examples / common.time_trainer(trainer, iterator, loops,
                                                   spl))
    rows.append({"model": model_name, "strategy": FLAGS.strategies[0],
                 "global_batch_size": batch,
                 "xla_mode": runs[1][0].jit_compile,
                 "plain_examples_per_s": statistics.median(rates[0]),
                 "xla_examples_per_s": statistics.median(rates[1]),
                 "xla_ratio": statistics.median(
                     [x / p for x, p in zip(rates[1], rates[0])]),
                 "load_average": os.getloadavg()[0]})
  return rows


def report(rows):
  print("\ndistloop Trainer with and without jit_compile (XLA), alternating "
        "rounds in one process per strategy (median)")
  header = (f"{'model':<11}{'strategy':<12}{'batch':>6}{'XLA part':>11}"
            f"{'plain ex/s':>12}{'XLA ex/s':>10}{'XLA/plain':>11}"
            f"{'load':>6}")
  print(header)
  print("-" * len(header))
  for r in rows:
    print(f"{r['model']:<11}{r['strategy']:<12}{r['global_batch_size']:>6}"
          f"{str(r['xla_mode']):>11}{r['plain_examples_per_s']:>12.1f}"
          f"{r['xla_examples_per_s']:>10.1f}{r['xla_ratio']:>11.3f}"
          f"{r['load_average']:>6.1f}")


def main(argv):
  del argv
  common.apply_quick()
  if FLAGS.result_file:
    common.write_json(FLAGS.result_file, measure())
    return
  models = f"--models={','.join(FLAGS.models)}"
  sizes = (f"--unet_image_size={FLAGS.unet_image_size}",
           f"--unet_batch_size={FLAGS.unet_batch_size}")
  rows = [row for spec in FLAGS.strategies
          for row in common.child(__file__, spec, models, *sizes)]
  report(rows)
  if FLAGS.output_json:
    common.write_json(FLAGS.output_json, {"rows": rows}, indent=2)


if __name__ == "__main__":
  app.run(main)
