"""The gradient all-reduce of a model whose variables have several dtypes
(a float16 layer beside float32 and float64 ones): each gradient summed in
its own dtype, with the default options and with each all-reduce option."""

import numpy as np
import tensorflow as tf

from framework.core import gradients
from framework.core.config import AllReduceConfig
from tests import shared_strategy

DTYPES = (tf.float32, tf.float64, tf.float16, tf.float32)
CONFIGS = (None, AllReduceConfig(), AllReduceConfig(dtype="bfloat16"),
           AllReduceConfig(overlap=True, bytes_per_pack=8))


def test_gradients_of_several_dtypes_are_summed_each_in_its_dtype():
  # The process's one MirroredStrategy (tests/shared_strategy.py): two
  # number their collectives alike and would clash.
  strategy = shared_strategy.mirrored()

  @tf.function
  def step():
    def replica_fn():
      context = tf.distribute.get_replica_context()
      r = tf.cast(context.replica_id_in_sync_group, tf.float32)
      values = [tf.cast(tf.fill([i + 1], 1. + r), d)
                for i, d in enumerate(DTYPES)]
      return [gradients.all_reduce_sum(context, values, config)
              for config in CONFIGS]
    return strategy.run(replica_fn)

  for config, sums in zip(CONFIGS, step()):
    for i, (s, d) in enumerate(zip(sums, DTYPES)):
      s = strategy.experimental_local_results(s)[0]
      assert s.dtype == d, config
      np.testing.assert_array_equal(np.asarray(s, np.float64),
                                    np.full([i + 1], 3.), err_msg=str(config))
