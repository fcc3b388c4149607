"""What EMA and test-time augmentation add to a finished run's accuracy.

    python scripts/benchmarks/eval_ablation.py --model_dir=/tmp/tta/seed_0

A run trained with `--ema_decay` leaves two sets of weights:
`model.weights.h5` (the moving average, what it evaluated and exported) and
`model.raw.weights.h5` (the weights the optimizer produced). This evaluates
both on the run's whole test set, with and without flip TTA, at the step
the run ended (for a `--stop_at_accuracy` run: the target evaluation), and
prints the four test accuracies. It is the ablation of EMA and TTA at a
fixed step, without training again; the time they save is read off the
curves (docs/results/time_to_accuracy.md).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

from framework.data.config import InputConfig  # pylint: disable=g-import-not-at-top
from framework.settings import default  # pylint: disable=g-import-not-at-top
from scripts import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", None, "A finished train.py run.",
                    required=True)
flags.DEFINE_string("data_dir", None, "Default: the run's.")
flags.DEFINE_integer("batch_size", 500, "Test examples per batch.")


def _accuracy(model, images, labels, mode):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework.core import evaluation  # pylint: disable=g-import-not-at-top
  from framework.data import inputs  # pylint: disable=g-import-not-at-top

  @tf.function
  def predict(batch):
    return tf.argmax(evaluation.eval_logits(model, inputs.to_float(batch), mode),
                     axis=-1, output_type=tf.int32)

  correct = 0
  for start in range(0, len(images), FLAGS.batch_size):
    batch = images[start:start + FLAGS.batch_size]
    predicted = predict(tf.constant(batch)).numpy()
    correct += int(np.sum(predicted == labels[start:start + len(batch)]))
  return correct / len(images)


def run():
  # pylint: disable=g-import-not-at-top
  import numpy as np
  from framework.app import export
  from framework.app.export import RAW_WEIGHTS_FILE, WEIGHTS_FILE
  from framework.data import datasets
  from framework.errors import ConfigError
  # pylint: enable=g-import-not-at-top
  info = export.read_model_info(FLAGS.model_dir)
  if info is None:
    raise ConfigError(f"model_dir={FLAGS.model_dir} has no model_info.json")
  weights = {name: os.path.join(FLAGS.model_dir, file) for name, file in (
      ("ema", WEIGHTS_FILE), ("raw", RAW_WEIGHTS_FILE))}
  if not os.path.exists(weights["raw"]):
    raise ConfigError(f"model_dir={FLAGS.model_dir} has no "
                      f"{RAW_WEIGHTS_FILE}: the run kept no EMA")
  # As evaluate.py: the run's data, seed (synthetic data) and options.
  dataset = datasets.load_dataset(
      info["dataset"], FLAGS.data_dir or info.get("data_dir"),
      seed=info.get("seed", default(InputConfig, "seed")),
      **info.get("dataset_options", {}))
  if not hasattr(dataset, "test_x"):
    raise ConfigError(f"dataset={info['dataset']}: only in-memory datasets "
                      "(cifar10, synthetic)")
  labels = np.asarray(dataset.test_y).reshape(-1)
  print(f"{FLAGS.model_dir}: {len(labels)} test examples")
  print(f"{'weights':<10}{'tta=none':>10}{'tta=flip':>10}")
  for name, path in weights.items():
    model = export.build_inference_model(info)
    model.load_weights(path)
    row = [_accuracy(model, dataset.test_x, labels, mode)
           for mode in ("none", "flip")]
    print(f"{name:<10}" + "".join(f"{100 * a:>9.2f}%" for a in row))


main = cli.main_running(run)

if __name__ == "__main__":
  app.run(main)
