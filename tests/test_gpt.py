"""--model=gpt: shapes, the causal mask, tied and untied heads, its checks,
and one step that lowers the loss."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
import models
from models import gpt

LENGTH, VOCAB, WIDTH = 12, 256, 32


def build(**options):
  options = dict(dict(num_layers=2, num_heads=4, model_width=WIDTH), **options)
  return models.build_model("gpt", (LENGTH,), VOCAB, **options)


def tokens(seed=0, batch=3):
  return np.random.default_rng(seed).integers(0, VOCAB, (batch, LENGTH),
                                              dtype=np.int32)


def test_shapes_and_parameter_counts():
  model = build()
  assert model.output_shape == (None, LENGTH, VOCAB)
  assert model(tokens()).shape == (3, LENGTH, VOCAB)
  hidden = 4 * WIDTH
  block = (2 * 2 * WIDTH                      # two layer norms
           + 4 * (WIDTH * WIDTH + WIDTH)      # q, k, v, out
           + WIDTH * hidden + hidden + hidden * WIDTH + WIDTH)  # MLP
  tied = VOCAB * WIDTH + LENGTH * WIDTH + 2 * block + 2 * WIDTH
  assert model.count_params() == tied
  assert build(tie_embeddings=False).count_params() == tied + WIDTH * VOCAB
  assert build(num_layers=3).count_params() == tied + block


def test_position_t_depends_on_tokens_up_to_t_only():
  model = build()
  x = tokens()
  base = model(x).numpy()
  for t in (0, 5, LENGTH - 2):
    changed = x.copy()
    changed[:, t + 1:] = (changed[:, t + 1:] + 7) % VOCAB
    out = model(changed).numpy()
    np.testing.assert_array_equal(out[:, :t + 1], base[:, :t + 1])
    assert np.abs(out[:, t + 1:] - base[:, t + 1:]).max() > 1e-4
  # And it does depend on the earlier tokens.
  changed = x.copy()
  changed[:, 0] = (changed[:, 0] + 1) % VOCAB
  assert np.abs(model(changed).numpy()[:, -1] - base[:, -1]).max() > 1e-4


def test_tied_head_is_the_token_table():
  model = build()
  embedding = model.get_layer("token_embedding")
  assert [v.path for v in embedding.weights] == ["token_embedding/embeddings"]
  final = model.get_layer("ln_f")
  x = tokens()
  sub = keras.Model(model.input, final.output)
  np.testing.assert_allclose(
      model(x).numpy(),
      sub(x).numpy() @ embedding.embeddings.numpy().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options,fragment", [
    (dict(num_heads=3), "model_width=32 is not divisible by num_heads=3"),
    (dict(vocab_size=100), "vocab_size=100 differs from the dataset's 256"),
    (dict(num_layers=0), "num_layers=0 must be an integer >= 1"),
])
def test_bad_sizes_are_one_config_error(options, fragment):
  with pytest.raises(framework.ConfigError) as e:
    build(**options)
  assert fragment in str(e.value)


def test_images_are_refused_naming_the_text_dataset():
  with pytest.raises(framework.ConfigError, match="--dataset=text"):
    models.build_model("gpt", (32, 32, 3), 10)


def test_one_adam_step_lowers_the_next_token_loss():
  model = build()
  optimizer = keras.optimizers.Adam(1e-2)
  x = tokens(batch=8)
  y = np.roll(x, -1, axis=1)

  def loss():
    logits = model(x)
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        y, logits, from_logits=True))

  before = float(loss())
  assert before == pytest.approx(np.log(VOCAB), abs=0.3)
  for _ in range(3):
    with tf.GradientTape() as tape:
      value = loss()
    grads = tape.gradient(value, model.trainable_variables)
    assert all(g is not None for g in grads)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
  assert float(loss()) < before - 0.1


def test_the_layers_math_is_reusable():
  rng = np.random.default_rng(0)
  q = tf.constant(rng.normal(size=[2, 4, 5, 8]), tf.float32)
  out = gpt.causal_attention(q, q, q)
  assert out.shape == (2, 4, 5, 8)
  x = tf.constant(rng.normal(size=[2, 5, 32]), tf.float32)
  np.testing.assert_array_equal(gpt.merge_heads(gpt.split_heads(x, 4)), x)
