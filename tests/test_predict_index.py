"""predict.py --index reads the run's own test split: TFRecords, an image
folder (its example numbering), with the true label."""

import os

import numpy as np
import pytest
from PIL import Image

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from framework.app import experiment, prediction
from framework.data import image_folder, tfrecords
from tests.helpers import run_script
from tests.shared_strategy import mirrored
from tests.test_tfrecords import _image_folder


def _train(model_dir, dataset, data_dir):
  config = framework.ExperimentConfig(
      model="mlp", dataset=dataset, data_dir=str(data_dir),
      model_dir=str(model_dir), strategy="mirrored", global_batch_size=4,
      train_steps=2, export_saved_model=False,
      loop=framework.LoopConfig(train_steps=2, steps_per_loop=2))
  experiment.run(config, strategy=mirrored())


def _predict_index(tmp_path, model_dir, class_names, image, label, source):
  saved = str(tmp_path / "seen.png")
  proc = run_script("predict.py", f"--model_dir={model_dir}", "--index=3",
                    f"--save_image={saved}")
  first = proc.stdout.splitlines()[0]
  assert first == f"image: {source} test #3 (true class: {class_names[label]})"
  np.testing.assert_array_equal(np.asarray(Image.open(saved)), image)


@pytest.mark.slow  # trains, then a predict.py process
def test_index_on_a_tfrecord_run(tmp_path):
  data = framework.data.datasets.synthetic(num_train=16, num_test=8, seed=2)
  for split, x, y in (("train", data.train_x, data.train_y),
                      ("test", data.test_x, data.test_y)):
    tfrecords.write_split(str(tmp_path / "records"), split,
                          lambda i, x=x, y=y: (x[i], y[i]), len(x),
                          num_shards=3, class_names=data.class_names,
                          name=data.name)
  _train(tmp_path / "run", "tfrecord", tmp_path / "records")
  # The shards hold a shuffled share: #3 is the example numbered 3.
  _predict_index(tmp_path, tmp_path / "run", data.class_names,
                 data.test_x[3], int(data.test_y[3]), "tfrecord")


@pytest.mark.slow  # trains, then a predict.py process
def test_index_on_an_image_folder_run(tmp_path):
  _image_folder(tmp_path / "photos", shape=(6, 5, 3))
  _train(tmp_path / "run", "image_folder", tmp_path / "photos")
  classes, splits = image_folder.scan(str(tmp_path / "photos"))
  path, label = splits["test"][3]
  image = np.asarray(Image.open(path))
  _predict_index(tmp_path, tmp_path / "run", classes, image, label,
                 "image_folder")
  info = {"dataset": "image_folder", "data_dir": str(tmp_path / "photos")}
  with pytest.raises(framework.DataError, match=r"index=6 is out of range.*"
                     r"has 6 examples"):
    prediction.test_example(info, 6)
