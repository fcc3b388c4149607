"""keras-io's keras.applications ResNet50 on CIFAR-10, ported: no model
code at all, `--model=keras.applications:ResNet50` (built by keyword for
32x32x3 and 10 classes, random weights, logits).

    python scripts/examples/resnet50_cifar10.py --strategy=mirrored \
        --cpu_devices=2 --global_batch_size=64 --train_steps=200 \
        --model_dir=/tmp/resnet50

is `scripts/train.py --model=keras.applications:ResNet50 --dataset=cifar10`
with those defaults (every train.py flag works; `--dataset=synthetic` needs
no download). Start from a weights file with
`--model_options=weights=PATH`.
"""

from distloop_cli import cli
cli.quiet_startup()  # Before TensorFlow is imported: train.py's quiet logs.

from absl import flags  # pylint: disable=g-import-not-at-top

from distloop_cli import train

FLAGS = flags.FLAGS


def main(argv):
  del argv
  train.run_main()


if __name__ == "__main__":
  FLAGS.set_default("model", "keras.applications:ResNet50")
  FLAGS.set_default("dataset", "cifar10")
  cli.run_app(main)
