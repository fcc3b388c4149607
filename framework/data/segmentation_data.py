"""Segmentation datasets: generated shapes, and the Oxford-IIIT Pet trimaps.

Both return an `ArrayDataset` whose labels are int32 masks [N, H, W] (one
class per pixel), registered in `framework.data.datasets.DATASETS` as `shapes` and
`oxford_pet`. `image_size` (a dataset option) is the side of the square
images.
"""

import os

import numpy as np

from framework.data import datasets
from framework.data.config import DatasetOptions, InputConfig
from framework.errors import ConfigError, DataError, check_positive
from framework.settings import default

SHAPES_CLASSES = ("background", "rectangle", "ellipse")
# Trimap values 1, 2, 3 become classes 0, 1, 2.
OXFORD_PET_CLASSES = ("pet", "background", "border")


def _shapes_split(rng, num_images, size):
  """Images with 1-3 rectangles and ellipses; masks give each pixel's shape."""
  rows, cols = np.mgrid[0:size, 0:size]
  images = np.empty((num_images, size, size, 3), np.uint8)
  masks = np.zeros((num_images, size, size), np.int32)
  for i in range(num_images):
    # A smooth random background, so colour alone does not give the answer.
    tint = rng.uniform(0, 160, size=3)
    ramp = rng.uniform(-40, 40, size=3)[None, None, :] * (rows / size)[..., None]
    image = tint + ramp + rng.normal(0, 12, size=(size, size, 3))
    mask = masks[i]
    for _ in range(rng.integers(1, 4)):
      kind = rng.integers(1, 3)
      cy, cx = rng.uniform(0.2, 0.8, size=2) * size
      hy, hx = rng.uniform(0.1, 0.25, size=2) * size
      if kind == 1:
        inside = (np.abs(rows - cy) <= hy) & (np.abs(cols - cx) <= hx)
      else:
        inside = ((rows - cy) / hy)**2 + ((cols - cx) / hx)**2 <= 1.0
      image[inside] = rng.uniform(60, 255, size=3)
      mask[inside] = kind
    images[i] = np.clip(image, 0, 255).astype(np.uint8)
  return images, masks


def shapes(num_train=1024, num_test=256,
           image_size=default(DatasetOptions, "image_size"),
           seed=default(InputConfig, "seed")):
  """A generated segmentation task: background, rectangles and ellipses."""
  check_positive("num_train", num_train)
  check_positive("num_test", num_test)
  check_positive("image_size", image_size)
  rng = np.random.default_rng(seed)
  train_x, train_y = _shapes_split(rng, num_train, image_size)
  test_x, test_y = _shapes_split(rng, num_test, image_size)
  return datasets.ArrayDataset("shapes", train_x, train_y, test_x, test_y,
                               SHAPES_CLASSES)


def _split_names(data_dir, stems):
  """(train, test) image names: the official split files when present."""
  lists = [os.path.join(data_dir, "annotations", f)
           for f in ("trainval.txt", "test.txt")]
  if all(os.path.isfile(f) for f in lists):
    splits = []
    for path in lists:
      with open(path) as f:
        names = [line.split()[0] for line in f
                 if line.strip() and not line.startswith("#")]
      splits.append([n for n in names if n in stems])
    return splits
  # No split files: every fifth image (sorted by name) is a test image.
  ordered = sorted(stems)
  return ([n for i, n in enumerate(ordered) if i % 5 != 4],
          [n for i, n in enumerate(ordered) if i % 5 == 4])


def _read_pair(data_dir, name, image_size):
  from PIL import Image  # pylint: disable=g-import-not-at-top
  image_path = os.path.join(data_dir, "images", name + ".jpg")
  trimap_path = os.path.join(data_dir, "annotations", "trimaps", name + ".png")
  size = (image_size, image_size)
  try:
    with Image.open(image_path) as image:
      image = np.asarray(image.convert("RGB").resize(size, Image.BILINEAR))
    with Image.open(trimap_path) as trimap:
      trimap = np.asarray(trimap.resize(size, Image.NEAREST))
  except OSError as e:
    raise DataError(f"cannot read Oxford-IIIT Pet example {name!r}: {e}") from None
  if trimap.ndim != 2 or trimap.min() < 1 or trimap.max() > 3:
    raise DataError(f"trimap {trimap_path} must hold values 1..3 in one "
                    f"channel (got shape {trimap.shape}, values "
                    f"{trimap.min()}..{trimap.max()})")
  return image, trimap.astype(np.int32) - 1


def load_oxford_pet(data_dir, image_size=default(DatasetOptions, "image_size")):
  """Reads the Oxford-IIIT Pet layout: images/*.jpg, annotations/trimaps/*.png.

  Images are resized bilinearly and trimaps by nearest neighbour to
  `image_size` squared; trimap labels 1-3 (pet, background, border) become
  classes 0-2. The split is annotations/trainval.txt and test.txt when they
  exist, else every fifth image by name is a test image.
  """
  check_positive("image_size", image_size)
  if not data_dir:
    raise ConfigError("dataset=oxford_pet needs data_dir (the directory "
                      "holding images/ and annotations/trimaps/)")
  images_dir = os.path.join(data_dir, "images")
  trimaps_dir = os.path.join(data_dir, "annotations", "trimaps")
  for path in (images_dir, trimaps_dir):
    if not os.path.isdir(path):
      raise DataError(f"data_dir={data_dir!r} is not an Oxford-IIIT Pet "
                      f"directory: {path} is missing (expected images/*.jpg "
                      "and annotations/trimaps/*.png)")
  stems = {f[:-4] for f in os.listdir(images_dir) if f.endswith(".jpg")}
  stems &= {f[:-4] for f in os.listdir(trimaps_dir)
            if f.endswith(".png") and not f.startswith(".")}
  train_names, test_names = _split_names(data_dir, stems)
  if not train_names or not test_names:
    raise DataError(f"data_dir={data_dir!r}: found {len(train_names)} "
                    f"training and {len(test_names)} test images with "
                    "trimaps; need at least one of each")

  def read(names):
    pairs = [_read_pair(data_dir, n, image_size) for n in names]
    return (np.stack([p[0] for p in pairs]),
            np.stack([p[1] for p in pairs]))

  train_x, train_y = read(train_names)
  test_x, test_y = read(test_names)
  return datasets.ArrayDataset("oxford_pet", train_x, train_y, test_x, test_y,
                               OXFORD_PET_CLASSES)


datasets.DATASETS["shapes"] = (
    lambda data_dir=None, seed=default(InputConfig, "seed"),
    image_size=default(DatasetOptions, "image_size"), **_: shapes(
        image_size=image_size, seed=seed))
datasets.DATASETS["oxford_pet"] = (
    lambda data_dir=None, image_size=default(DatasetOptions, "image_size"),
    **_: load_oxford_pet(data_dir, image_size=image_size))
