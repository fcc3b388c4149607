"""U-Net, segmentation data, per-pixel metrics over replicas, mask summaries."""

import glob
import io
import os

import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
import framework.data.inputs  # noqa: F401  (the attribute chain below)
import framework.tasks.segmentation  # noqa: F401  (the attribute chain below)
import models
from framework.data import segmentation_data
from framework.tasks import segmentation
from framework.tasks.segmentation import iou_metrics
from tests.helpers import run_script
from tests.shared_strategy import mirrored


def test_unet_outputs_logits_per_pixel():
  model = models.build_model("unet", (128, 128, 3), 3)
  assert model.output_shape == (None, 128, 128, 3)
  small = models.build_model("unet", (32, 32, 3), 3, depth=2, width=8)
  assert small.output_shape == (None, 32, 32, 3)
  assert small.count_params() < model.count_params() / 50
  with pytest.raises(framework.ConfigError, match="multiples of 2\\*\\*depth=8"):
    models.build_model("unet", (36, 36, 3), 3, depth=3)
  with pytest.raises(framework.ConfigError, match="depth=0"):
    models.build_model("unet", (32, 32, 3), 3, depth=0)


def test_shapes_dataset():
  data = framework.data.datasets.load_dataset("shapes", seed=3, image_size=32)
  assert data.train_x.shape[1:] == (32, 32, 3)
  assert data.train_x.dtype == np.uint8
  assert data.train_y.shape[1:] == (32, 32)
  assert set(np.unique(data.train_y)) == {0, 1, 2}
  assert data.class_names == ("background", "rectangle", "ellipse")
  again = segmentation_data.shapes(num_train=len(data.train_x),
                                   num_test=len(data.test_x), image_size=32,
                                   seed=3)
  np.testing.assert_array_equal(again.test_y, data.test_y)
  assert segmentation.is_segmentation(data)


def _write_pet(root, names, split_files):
  from PIL import Image  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  os.makedirs(root / "images")
  os.makedirs(root / "annotations" / "trimaps")
  for name in names:
    Image.fromarray(rng.integers(0, 255, (30, 40, 3), np.uint8)).save(
        root / "images" / f"{name}.jpg")
    trimap = np.ones((30, 40), np.uint8)   # pet
    trimap[:, 20:] = 2                     # background
    trimap[:5] = 3                         # border
    Image.fromarray(trimap).save(root / "annotations" / "trimaps" /
                                 f"{name}.png")
  if split_files:
    (root / "annotations" / "trainval.txt").write_text(
        "".join(f"{n} 1 1 1\n" for n in names[:3]))
    (root / "annotations" / "test.txt").write_text(f"{names[3]} 1 1 1\n")


def test_oxford_pet_reader(tmp_path):
  names = ["Abyssinian_1", "beagle_2", "pug_3", "yorkie_4", "boxer_5"]
  _write_pet(tmp_path / "a", names, split_files=True)
  data = framework.data.datasets.load_dataset("oxford_pet", str(tmp_path / "a"),
                                image_size=16)
  assert data.train_x.shape == (3, 16, 16, 3)
  assert data.test_x.shape == (1, 16, 16, 3)
  assert data.class_names == ("pet", "background", "border")
  mask = data.train_y[0]
  assert mask.shape == (16, 16)
  assert mask[8, 2] == 0 and mask[8, 14] == 1 and mask[0, 2] == 2
  # Without split files, every fifth image by name is a test image.
  _write_pet(tmp_path / "b", names, split_files=False)
  data = framework.data.datasets.load_dataset("oxford_pet", str(tmp_path / "b"),
                                image_size=16)
  assert (len(data.train_x), len(data.test_x)) == (4, 1)
  with pytest.raises(framework.DataError, match="trimaps"):
    framework.data.datasets.load_dataset("oxford_pet", str(tmp_path))


def test_segmentation_eval_is_reduced_over_replicas():
  """Two replicas and a partial batch give the single-pass numpy values."""
  strategy = mirrored()
  assert strategy.num_replicas_in_sync == 2
  data = segmentation_data.shapes(num_train=4, num_test=11, image_size=16,
                                  seed=5)
  tf.keras.utils.set_random_seed(0)
  with strategy.scope():
    model = models.build_model("unet", (16, 16, 3), 3, depth=1, width=4)
    optimizer = tf.keras.optimizers.SGD()
  trainer = framework.tasks.segmentation.SegmentationTrainer(model, optimizer, strategy,
                                          global_batch_size=4)
  results = trainer.evaluate(framework.data.inputs.distribute_eval(
      strategy, data.test_x, data.test_y, 4))
  logits = model(data.test_x.astype(np.float32) / 255.0).numpy()
  predicted = logits.argmax(-1)
  labels = data.test_y
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  loss = -np.take_along_axis(log_probs, labels[..., None], -1).mean()
  confusion = np.zeros((3, 3))
  np.add.at(confusion, (labels.ravel(), predicted.ravel()), 1)
  _, mean_iou = iou_metrics(confusion)
  assert results["examples"] == 11
  np.testing.assert_allclose(trainer.last_confusion, confusion)
  assert results["pixel_accuracy"] == pytest.approx(
      (predicted == labels).mean(), abs=1e-6)
  assert results["mean_iou"] == pytest.approx(mean_iou, abs=1e-6)
  assert results["loss"] == pytest.approx(loss, abs=1e-5)


def test_per_pixel_loss_is_the_mean_over_all_pixels_of_the_global_batch():
  strategy = mirrored()
  data = segmentation_data.shapes(num_train=8, num_test=2, image_size=8,
                                  seed=6)
  tf.keras.utils.set_random_seed(0)
  with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((8, 8, 3)),
                                 tf.keras.layers.Conv2D(3, 3, padding="same")])
    optimizer = tf.keras.optimizers.SGD(0.0)
  trainer = framework.Trainer(model, optimizer, strategy, global_batch_size=8)
  logits = model(data.train_x.astype(np.float32) / 255.0).numpy()
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  expected = -np.take_along_axis(log_probs, data.train_y[..., None], -1).mean()
  batches = iter(framework.data.inputs.distribute_train(strategy, data, 8))
  metrics = trainer.train(batches, 1)
  assert float(metrics["loss"]) == pytest.approx(expected, abs=1e-5)


def _event_tensors(logdir):
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  acc = event_accumulator.EventAccumulator(
      logdir, size_guidance={event_accumulator.TENSORS: 0})
  acc.Reload()
  return acc


@pytest.mark.slow
def test_unet_learns_shapes_on_two_replicas_with_mask_summaries(tmp_path):
  model_dir = str(tmp_path / "unet")
  run_script("train.py", "--model=unet", "--dataset=shapes",
             "--image_size=32", "--unet_depth=2", "--unet_width=8",
             "--strategy=mirrored", "--cpu_devices=2", "--train_steps=200",
             "--steps_per_loop=100", "--global_batch_size=32",
             "--learning_rate=3e-3", f"--model_dir={model_dir}",
             timeout=400)
  acc = _event_tensors(os.path.join(model_dir, "eval"))
  tags = acc.Tags()["tensors"]
  mean_iou = float(tf.make_ndarray(acc.Tensors("mean_iou")[-1].tensor_proto))
  pixel_accuracy = float(tf.make_ndarray(
      acc.Tensors("pixel_accuracy")[-1].tensor_proto))
  print(f"mean_iou={mean_iou:.4f} pixel_accuracy={pixel_accuracy:.4f}")
  # Chance: all background gives IoU ~0.8 for one class of three, ~0.27.
  assert mean_iou > 0.5
  assert segmentation.TRIPLETS_TAG in tags
  event = acc.Tensors(segmentation.TRIPLETS_TAG)[-1]
  assert event.step == 200
  encoded = tf.make_ndarray(event.tensor_proto)
  assert len(encoded) == 2 + 3  # width, height, then three PNG triplets
  from PIL import Image  # pylint: disable=g-import-not-at-top
  triplet = np.asarray(Image.open(io.BytesIO(encoded[2])))
  assert triplet.shape == (32, 3 * 32, 3)
  # The middle third is the true mask, drawn in the class palette.
  data = segmentation_data.shapes(image_size=32, seed=0)
  np.testing.assert_array_equal(triplet[:, 32:64],
                                segmentation.colorize(data.test_y[0]))
  assert glob.glob(os.path.join(model_dir, "export", "saved_model.pb"))
