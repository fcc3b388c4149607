"""Input pipelines are a pure function of (seed, step): resumable exactly."""

import numpy as np
import pytest

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
import framework.data.inputs  # noqa: F401  (the attribute chain below)
from framework.data import inputs


@pytest.fixture(scope="module")
def data():
  return framework.data.datasets.synthetic(num_train=100, num_test=10, image_shape=(2, 2, 1))


def batches(dataset, count):
  return [(x.numpy(), y.numpy()) for x, y in dataset.take(count)]


def test_restart_at_step_continues_the_same_stream(data):
  # 100 examples at batch 16: 6 steps per epoch, so step 9 is mid-epoch 2.
  full = batches(framework.data.inputs.train_dataset(data, 16, seed=5), 14)
  resumed = batches(framework.data.inputs.train_dataset(data, 16, seed=5, start_step=9), 5)
  for (x1, y1), (x2, y2) in zip(full[9:], resumed):
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)


def test_each_epoch_is_a_new_permutation(data):
  epoch0, epoch1 = (np.concatenate([y for _, y in b]) for b in (
      batches(framework.data.inputs.train_dataset(data, 16, seed=5), 6),
      batches(framework.data.inputs.train_dataset(data, 16, seed=5, start_step=6), 6)))
  x0 = batches(framework.data.inputs.train_dataset(data, 16, seed=5), 6)
  flat = np.concatenate([x.reshape(len(x), -1) for x, _ in x0])
  assert len({row.tobytes() for row in flat}) == 96  # no repeats in an epoch
  assert not np.array_equal(epoch0, epoch1)


def test_eval_dataset_pads_the_partial_batch(data):
  batches = list(framework.data.inputs.eval_dataset(data.test_x, data.test_y, 4))
  assert [b.batch[1].shape[0] for b in batches] == [4, 4, 4]
  assert [b.mask.numpy().tolist() for b in batches] == [[1] * 4, [1] * 4,
                                                        [1, 1, 0, 0]]
  np.testing.assert_array_equal(batches[2].batch[1][:2], data.test_y[8:])
  assert not batches[2].batch[0][2:].numpy().any()  # padding: zeros
  sizes = [len(y) for _, y in framework.data.inputs.eval_dataset(data.test_x, data.test_y,
                                                     4, pad=False)]
  assert sizes == [4, 4, 2]


def test_batch_larger_than_the_data_is_an_error(data):
  with pytest.raises(framework.ConfigError, match="global_batch_size=128"):
    framework.data.inputs.train_dataset(data, 128)


def test_unknown_input_mode(data):
  with pytest.raises(framework.ConfigError, match="input_mode='both'"):
    inputs.distribute_train(framework.make_strategy("default"), data, 16,
                            input_mode="both")
