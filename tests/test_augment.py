"""crop_flip and flip: per-example, deterministic, a real crop/flip."""

import numpy as np
import tensorflow as tf

from framework.data import preprocessing


def test_crop_flip_is_a_shifted_or_mirrored_window():
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(64, 8, 8, 3)).astype(np.float32)
  seeds = np.stack([np.full(64, 5), np.arange(64)], 1).astype(np.int64)
  out, labels = preprocessing.crop_flip(tf.constant(images), tf.range(64),
                                  tf.constant(seeds), padding=2)
  out = out.numpy()
  assert out.shape == images.shape
  np.testing.assert_array_equal(labels.numpy(), np.arange(64))
  padded = np.pad(images, [(0, 0), (2, 2), (2, 2), (0, 0)])
  kinds = set()
  for i in range(64):
    # Exactly one (top, left, flip) explains the output.
    matches = [(t, l, f) for t in range(5) for l in range(5) for f in (0, 1)
               if np.array_equal(out[i], (lambda w: w[:, ::-1] if f else w)(
                   padded[i, t:t + 8, l:l + 8]))]
    assert len(matches) >= 1, i
    kinds.add(matches[0])
  assert len(kinds) > 10  # different examples get different windows
  assert {k[2] for k in kinds} == {0, 1}
  # The same seeds give the same images (restarts, replica counts).
  again, _ = preprocessing.crop_flip(tf.constant(images), tf.range(64),
                               tf.constant(seeds), padding=2)
  np.testing.assert_array_equal(again.numpy(), out)


def test_flip_mirrors_about_half_and_keeps_the_rest():
  rng = np.random.default_rng(1)
  images = rng.uniform(size=(200, 6, 6, 3)).astype(np.float32)
  seeds = np.stack([np.full(200, 9), np.arange(200)], 1).astype(np.int64)
  out, labels = preprocessing.get_augmentation("flip")(
      tf.constant(images), tf.range(200), tf.constant(seeds))
  out = out.numpy()
  np.testing.assert_array_equal(labels.numpy(), np.arange(200))
  mirrored = [np.array_equal(o, i[:, ::-1]) for o, i in zip(out, images)]
  kept = [np.array_equal(o, i) for o, i in zip(out, images)]
  # Each image is itself or its mirror (never both: random pixels).
  assert all(m != k for m, k in zip(mirrored, kept))
  assert 70 < sum(mirrored) < 130
  again, _ = preprocessing.flip(tf.constant(images), tf.range(200),
                          tf.constant(seeds))
  np.testing.assert_array_equal(again.numpy(), out)


def test_unknown_augmentation_is_rejected():
  import pytest  # pylint: disable=g-import-not-at-top
  import framework  # pylint: disable=g-import-not-at-top
  with pytest.raises(framework.ConfigError, match="augment='mixup'"):
    preprocessing.get_augmentation("mixup")
  assert preprocessing.get_augmentation("none") is None
