"""A model whose graph runs a loop (an RNN's While) has no FLOP count:
its matmuls run once per iteration inside the loop's body, so counting the
outer graph's ops would report a fraction of them (and an MFU far too low)."""

import keras
import pytest

from framework.perf import flops


def test_rnn_flops_are_not_counted_from_the_outer_graph():
  inputs = keras.Input((16, 3))
  outputs = keras.layers.Dense(4)(keras.layers.LSTM(8)(inputs))
  model = keras.Model(inputs, outputs)
  with pytest.raises(ValueError, match="While"):
    flops.model_flops_per_example(model, (16, 3))


def test_a_model_without_loops_is_still_counted():
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
  # Forward and weight gradient; no input gradient for the first layer.
  assert flops.model_flops_per_example(model, (3,)) == 2 * 3 * 4 * 2
