"""Text from a trained language model: a prompt continued token by token.

    info, weights = prediction.resolve_model(model_dir=...)
    model = prediction.load_model(info, weights)
    text = generate_text(model, "def ", max_new_tokens=200)   # greedy
    text = generate_text(model, "def ", 200, temperature=0.8, seed=1)

Tokens are bytes (`--dataset=text`). The model takes a fixed window of
`sequence_length` tokens: the context is the last `sequence_length` tokens,
padded on the right, and the next token is read at the context's last
real position (the model is causal, so the padding after it changes
nothing). Greedy decoding (`temperature=0`) is deterministic; sampling
draws from softmax(logits / temperature) with a numpy generator seeded by
`seed`, so a seed gives the same text every time.
"""

import numpy as np
import tensorflow as tf

from framework.app.predict_config import PredictConfig
from framework.errors import ConfigError, check_positive
from framework.settings import default
from framework.tasks.language_model import TASK


def check_language_model(info):
  """ConfigError unless `info` (model_info.json) describes a language model."""
  if info.get("task") != TASK:
    raise ConfigError(
        f"--prompt: model={info['model']} was trained on dataset="
        f"{info.get('dataset')}, not a text dataset; generating text needs a "
        "language model (e.g. --model=gpt --dataset=text)")


def generate(model, prompt,
             max_new_tokens=default(PredictConfig, "max_new_tokens"), *,
             temperature=default(PredictConfig, "temperature"),
             seed=default(PredictConfig, "seed")):
  """`prompt` (token ids) followed by `max_new_tokens` generated ones.

  Args:
    model: tokens int32 [1, T] -> logits [1, T, vocab], causal.
    prompt: a non-empty sequence of token ids.
    temperature: 0: the most likely token each time; > 0: sampled.
  """
  check_positive("max_new_tokens", max_new_tokens)
  if not temperature >= 0:
    raise ConfigError(f"temperature={temperature!r} must be >= 0 (0: greedy)")
  tokens = [int(t) for t in prompt]
  if not tokens:
    raise ConfigError("prompt is empty: give at least one token")
  length = int(model.input_shape[-1])
  vocab = int(model.output_shape[-1])
  if max(tokens) >= vocab or min(tokens) < 0:
    raise ConfigError(f"prompt token {max(tokens)} is outside the model's "
                      f"vocabulary of {vocab}")
  rng = np.random.default_rng(seed)
  forward = tf.function(lambda x: model(x, training=False),
                        input_signature=[tf.TensorSpec([1, length],
                                                       tf.int32)])
  for _ in range(max_new_tokens):
    context = tokens[-length:]
    window = np.zeros([1, length], np.int32)
    window[0, :len(context)] = context
    logits = np.asarray(forward(tf.constant(window)))[0, len(context) - 1]
    logits = logits.astype(np.float64)
    if temperature == 0:
      tokens.append(int(np.argmax(logits)))
      continue
    scaled = logits / temperature
    probabilities = np.exp(scaled - scaled.max())
    probabilities /= probabilities.sum()
    tokens.append(int(rng.choice(vocab, p=probabilities)))
  return tokens


def generate_text(model, prompt,
                  max_new_tokens=default(PredictConfig, "max_new_tokens"), *,
                  temperature=default(PredictConfig, "temperature"),
                  seed=default(PredictConfig, "seed")):
  """`prompt` (a str, as UTF-8 bytes) continued by `max_new_tokens` bytes,
  decoded as UTF-8 (invalid sequences replaced)."""
  tokens = generate(model, list(prompt.encode("utf-8")), max_new_tokens,
                    temperature=temperature, seed=seed)
  return bytes(tokens).decode("utf-8", errors="replace")
