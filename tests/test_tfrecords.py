"""The TFRecord format, the converter (scripts/make_tfrecords.py) and image
folders, on small files the tests write."""

import os

import numpy as np
from PIL import Image
import pytest

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
import framework.tasks.segmentation  # noqa: F401  (the attribute chain below)
from framework.data import file_input, image_folder, segmentation_data, tfrecords
from tests.helpers import run_script


def _write(path, data, num_shards=3):
  for split, x, y in (("train", data.train_x, data.train_y),
                      ("test", data.test_x, data.test_y)):
    tfrecords.write_split(str(path), split, lambda i, x=x, y=y: (x[i], y[i]),
                          len(x), num_shards=num_shards,
                          class_names=data.class_names, name=data.name)


def test_round_trip_classification_and_masks(tmp_path):
  for name, data in (
      ("cls", framework.data.datasets.synthetic(num_train=40, num_test=9,
                                  image_shape=(5, 6, 3), seed=2)),
      ("seg", segmentation_data.shapes(num_train=6, num_test=3,
                                       image_size=16))):
    _write(tmp_path / name, data)
    for split, x, y in (("train", data.train_x, data.train_y),
                        ("test", data.test_x, data.test_y)):
      index, images, labels = tfrecords.read_split_arrays(
          str(tmp_path / name), split)
      np.testing.assert_array_equal(index, np.arange(len(x)))
      np.testing.assert_array_equal(images, x)
      np.testing.assert_array_equal(labels, y)
    loaded = file_input.load_tfrecord(str(tmp_path / name))
    assert loaded.input_shape == data.input_shape
    assert loaded.label_shape == data.label_shape
    assert loaded.class_names == data.class_names
    assert framework.tasks.segmentation.is_segmentation(loaded) == (name == "seg")


def test_shards_hold_a_shuffled_share(tmp_path):
  data = framework.data.datasets.synthetic(num_train=40, num_test=9, image_shape=(4, 4, 3))
  _write(tmp_path, data, num_shards=4)
  sidecar = tfrecords.read_sidecar(str(tmp_path), "train")
  assert sidecar["examples_per_shard"] == [10, 10, 10, 10]
  # Not the source order cut in four: each shard is a seeded sample.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  parse = tfrecords.parse_fn((4, 4, 3), ())
  first = [int(parse(r)[0]) for r in tf.data.TFRecordDataset(
      str(tmp_path / sidecar["shards"][0]))]
  assert sorted(first) != list(range(10))


def test_converter_cifar10_round_trip(tmp_path):
  rng = np.random.default_rng(0)
  train_x = rng.integers(0, 256, (30, 32, 32, 3), dtype=np.uint8)
  test_x = rng.integers(0, 256, (11, 32, 32, 3), dtype=np.uint8)
  train_y, test_y = rng.integers(0, 10, 30), rng.integers(0, 10, 11)
  framework.data.datasets.write_cifar10(str(tmp_path / "src"), train_x, train_y, test_x,
                          test_y)
  out = tmp_path / "out"
  proc = run_script("make_tfrecords.py", "--dataset=cifar10",
                    f"--data_dir={tmp_path / 'src'}", f"--output_dir={out}",
                    "--num_shards=4")
  assert "(100%)" in proc.stderr  # the progress lines
  for split, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
    _, images, labels = tfrecords.read_split_arrays(str(out), split)
    np.testing.assert_array_equal(images, x)
    np.testing.assert_array_equal(labels, y)
  assert file_input.load_tfrecord(str(out)).class_names[0] == "airplane"
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]


def _image_folder(root, classes=("cat", "dog", "eel"), per_class=4,
                  shape=(6, 5, 3)):
  """root/train/<class>/*.png and root/test/<class>/*.png; the arrays."""
  rng = np.random.default_rng(1)
  arrays = {}
  for split, n in (("train", per_class), ("test", 2)):
    images, labels = [], []
    for label, name in enumerate(classes):
      os.makedirs(root / split / name)
      for i in range(n):
        image = rng.integers(0, 256, shape, dtype=np.uint8)
        Image.fromarray(image).save(root / split / name / f"{i:03d}.png")
        images.append(image)
        labels.append(label)
    arrays[split] = (np.stack(images), np.array(labels))
  return arrays


def test_image_folder_converter_and_streaming(tmp_path):
  arrays = _image_folder(tmp_path / "src")
  out = tmp_path / "out"
  run_script("make_tfrecords.py", "--dataset=image_folder",
             f"--data_dir={tmp_path / 'src'}", f"--output_dir={out}",
             "--num_shards=2")
  converted = file_input.load_tfrecord(str(out))
  assert converted.class_names == ("cat", "dog", "eel")
  streamed = image_folder.load_image_folder(str(tmp_path / "src"),
                                            files_per_shard=5)
  assert streamed.class_names == ("cat", "dog", "eel")
  assert streamed.input_shape == (6, 5, 3)
  for split, (x, y) in arrays.items():
    _, images, labels = tfrecords.read_split_arrays(str(out), split)
    np.testing.assert_array_equal(images, x)  # index order = (class, name)
    np.testing.assert_array_equal(labels, y)
  # Streaming the folder itself gives the same test examples once each.
  got = [(xb.numpy(), yb.numpy()) for xb, yb in streamed.eval_dataset(4, pad=False)]
  images = np.concatenate([g[0] for g in got])
  labels = np.concatenate([g[1] for g in got])
  x, y = arrays["test"]
  assert len(images) == len(x)
  key = lambda im, lab: (int(lab), (im * 255).round().astype(np.uint8).tobytes())
  assert sorted(key(a, b) for a, b in zip(images, labels)) == sorted(
      key(a / 255.0, b) for a, b in zip(x, y))


def test_image_folder_split_fraction(tmp_path):
  arrays = _image_folder(tmp_path / "src")
  names, splits = image_folder.scan(str(tmp_path / "src" / "train"), 0.25)
  assert names == ["cat", "dog", "eel"]
  assert len(splits["test"]) == 3 and len(splits["train"]) == 9
  assert not set(splits["test"]) & set(splits["train"])
  del arrays


@pytest.mark.parametrize("problem", ["unreadable", "mixed", "empty"])
def test_bad_converter_input_is_one_line(tmp_path, problem):
  src = tmp_path / "src"
  _image_folder(src)
  expected = {"unreadable": "cannot read image", "mixed": "different sizes",
              "empty": "has no images"}[problem]
  if problem == "unreadable":
    (src / "train" / "dog" / "001.png").write_bytes(b"not a png")
  elif problem == "mixed":
    Image.fromarray(np.zeros((9, 9, 3), np.uint8)).save(
        src / "test" / "eel" / "big.png")
  else:
    os.makedirs(src / "train" / "fox")
    os.makedirs(src / "test" / "fox")
  out = tmp_path / "out"
  proc = run_script("make_tfrecords.py", "--dataset=image_folder",
                    f"--data_dir={src}", f"--output_dir={out}", check=False)
  assert proc.returncode == 1, proc.stderr[-2000:]
  lines = [l for l in proc.stderr.splitlines()
           if l.startswith("make_tfrecords.py: error: ")]
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert expected in lines[0]
  assert sorted(os.listdir(tmp_path)) == ["src"]  # nothing written
