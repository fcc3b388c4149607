"""A GPT-style decoder-only transformer language model (nanoGPT's layout).

    tokens [B, T] -> token + position embeddings
                  -> num_layers x Block: x + attn(ln1(x)); x + mlp(ln2(x))
                  -> ln_f -> logits [B, T, vocab] (tied: the token table)

The pieces are small layers (`CausalSelfAttention`, `MLP`, `Block`,
`ReversibleEmbedding`) whose math lives in functions (`causal_attention`,
`split_heads`, `merge_heads`), so that a tensor-parallel version can hold
a slice of each weight (heads of Q/K/V, columns then rows of the MLP) and
run the same math on it. Logits at position t depend on tokens 0..t only.

Split (`devices=`, see `models/gpt_parallel.py`), the same layers hold
Megatron-style parallel sublayers instead (`framework.model_parallel.
parallel_layers`): Q/K/V and the MLP's first Dense cut by columns (heads),
the attention output and the MLP's second Dense by rows, and their
`split_call` runs one shard per device with one all-reduce per sub-layer.
"""

import math

import keras
from keras import ops

from framework.errors import ConfigError
from framework.model_parallel import parallel_layers
from framework.model_parallel import recompute
from framework.perf import flops
from framework.settings import default
from models.options import ModelOptions
from models.registry import register


def split_heads(x, num_heads):
  """[B, T, H * D] -> [B, H, T, D]."""
  batch, length = ops.shape(x)[0], ops.shape(x)[1]
  x = ops.reshape(x, (batch, length, num_heads, x.shape[-1] // num_heads))
  return ops.transpose(x, (0, 2, 1, 3))


def merge_heads(x):
  """[B, H, T, D] -> [B, T, H * D]."""
  heads, depth = x.shape[1], x.shape[3]
  x = ops.transpose(x, (0, 2, 1, 3))
  batch, length = ops.shape(x)[0], ops.shape(x)[1]
  return ops.reshape(x, (batch, length, heads * depth))


def causal_attention(q, k, v):
  """Softmax(q k^T / sqrt(D)) v over positions <= t; q, k, v [B, H, T, D].

  Scores and softmax in float32 (a float16 mask value would overflow).
  """
  depth = q.shape[-1]
  scores = ops.matmul(ops.cast(q, "float32"),
                      ops.transpose(ops.cast(k, "float32"), (0, 1, 3, 2)))
  scores = scores / math.sqrt(depth)
  length = ops.shape(scores)[-1]
  # Row t keeps columns 0..t; the diagonal is never masked, so no row is
  # all -inf.
  causal = ops.tril(ops.ones((length, length), "bool"))
  scores = ops.where(causal, scores, ops.full_like(scores, -1e30))
  weights = ops.cast(ops.softmax(scores, axis=-1), v.dtype)
  return ops.matmul(weights, v)


class CausalSelfAttention(keras.layers.Layer):
  """Multi-head causal self-attention: Q, K, V projections, the attention
  of each head, one output projection. Q/K/V are separate Dense layers so
  that a split by heads is a split of their columns."""

  def __init__(self, width, num_heads, devices=None, **kwargs):
    super().__init__(**kwargs)
    if width % num_heads:
      raise ConfigError(f"gpt model_width={width} is not divisible by "
                        f"num_heads={num_heads}; use a multiple of it")
    self.width = width
    self.num_heads = num_heads
    self.devices = tuple(devices or ())
    # --recompute=attention (fixed when made: `recompute.policy`).
    self.recompute_segment = recompute.wants("attention")
    if self.devices:
      parallel_layers.check_divides(len(self.devices), num_heads=num_heads)
      column = lambda name: parallel_layers.ColumnParallelLinear(
          width, self.devices, name=name)
      self.query, self.key, self.value = map(column, ("query", "key",
                                                      "value"))
      self.out = parallel_layers.RowParallelLinear(width, self.devices,
                                                   name="out")
      return
    self.query = keras.layers.Dense(width, name="query", dtype=self.dtype_policy)
    self.key = keras.layers.Dense(width, name="key", dtype=self.dtype_policy)
    self.value = keras.layers.Dense(width, name="value", dtype=self.dtype_policy)
    self.out = keras.layers.Dense(width, name="out", dtype=self.dtype_policy)

  def build(self, input_shape):
    for layer in (self.query, self.key, self.value):
      layer.build(input_shape)
    self.out.build(input_shape[:-1] + (self.width,))

  def call(self, x):
    return recompute.segment(self, "attention", self._attend, x)

  def _attend(self, x):
    q, k, v = (split_heads(layer(x), self.num_heads)
               for layer in (self.query, self.key, self.value))
    return self.out(merge_heads(causal_attention(q, k, v)))

  def shard(self, d, x):
    """Split: shard d's heads, up to its partial output projection."""
    def attend(x):
      # On shard d's device in the recomputation too.
      with parallel_layers.maybe_device(self.devices[d:d + 1]):
        heads = self.num_heads // len(self.devices)
        q, k, v = (split_heads(layer.shard(d, x), heads)
                   for layer in (self.query, self.key, self.value))
        return self.out.partial(d, merge_heads(causal_attention(q, k, v)))
    return recompute.segment(self, "attention", attend, x)

  def get_config(self):
    return {**super().get_config(), "width": self.width,
            "num_heads": self.num_heads}


class MLP(keras.layers.Layer):
  """Dense(hidden, GELU) then Dense(width): column- then row-parallel
  under a tensor split."""

  def __init__(self, width, hidden, devices=None, **kwargs):
    super().__init__(**kwargs)
    self.width = width
    self.hidden = hidden
    self.devices = tuple(devices or ())
    if self.devices:
      self.fc = parallel_layers.ColumnParallelLinear(
          hidden, self.devices, activation="gelu", name="fc")
      self.proj = parallel_layers.RowParallelLinear(width, self.devices,
                                                    name="proj")
      return
    self.fc = keras.layers.Dense(hidden, activation="gelu", name="fc",
                                 dtype=self.dtype_policy)
    self.proj = keras.layers.Dense(width, name="proj", dtype=self.dtype_policy)

  def build(self, input_shape):
    self.fc.build(input_shape)
    self.proj.build(input_shape[:-1] + (self.hidden,))

  def call(self, x):
    return self.proj(self.fc(x))

  def shard(self, d, x):
    """Split: shard d's hidden units, up to its partial product."""
    return self.proj.partial(d, self.fc.shard(d, x))

  def get_config(self):
    return {**super().get_config(), "width": self.width,
            "hidden": self.hidden}


class Block(keras.layers.Layer):
  """A pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

  def __init__(self, width, num_heads, hidden, devices=None, **kwargs):
    super().__init__(**kwargs)
    self.width, self.num_heads, self.hidden = width, num_heads, hidden
    self.devices = tuple(devices or ())
    # --recompute=blocks (fixed when made: `recompute.policy`).
    self.recompute_segment = recompute.wants("block")
    policy = self.dtype_policy
    self.ln1 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln1",
                                               dtype=policy)
    self.attention = CausalSelfAttention(width, num_heads, devices,
                                         name="attention", dtype=policy)
    self.ln2 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln2",
                                               dtype=policy)
    self.mlp = MLP(width, hidden, devices, name="mlp", dtype=policy)

  def build(self, input_shape):
    for layer in (self.ln1, self.attention, self.ln2, self.mlp):
      # Split: the layer norms (replicated) live on the first device.
      with parallel_layers.maybe_device(self.devices[:1]):
        layer.build(input_shape)

  def call(self, x):
    return recompute.segment(self, "block", self._residual, x)

  def _residual(self, x):
    x = x + self.attention(self.ln1(x))
    return x + self.mlp(self.ln2(x))

  def split_call(self, xs):
    """Split: `xs` one copy of the residual stream per device (equal
    values); each sub-layer's shards, one all-reduce, the residual add."""
    return recompute.segment(self, "block",
                             lambda *xs: self._split_residual(list(xs)), *xs)

  def _split_residual(self, xs):
    for norm, layer, output in ((self.ln1, self.attention, self.attention.out),
                                (self.ln2, self.mlp, self.mlp.proj)):
      partials = [parallel_layers.on_device(
          device, lambda x, d=d, norm=norm, layer=layer: layer.shard(
              d, norm(x)), x) for d, (device, x) in enumerate(
                  zip(self.devices, xs))]
      sums = parallel_layers.all_reduce(partials, self.devices)
      xs = [parallel_layers.on_device(
          device, lambda x, s, output=output: x + output.add_bias(s), x, s)
            for device, x, s in zip(self.devices, xs, sums)]
    return xs

  def get_config(self):
    return {**super().get_config(), "width": self.width,
            "num_heads": self.num_heads, "hidden": self.hidden}


class ReversibleEmbedding(keras.layers.Layer):
  """Token embedding [vocab, width]; `reverse=True` maps [.., width] to
  logits [.., vocab]: with `tied`, through the same table (transposed),
  else through a kernel of its own."""

  def __init__(self, vocab_size, width, tied=True, **kwargs):
    super().__init__(**kwargs)
    self.vocab_size, self.width, self.tied = vocab_size, width, tied

  def build(self, input_shape=None):
    init = keras.initializers.RandomNormal(stddev=0.02)
    self.embeddings = self.add_weight(
        shape=(self.vocab_size, self.width), initializer=init,
        name="embeddings")
    if not self.tied:
      self.reverse_kernel = self.add_weight(
          shape=(self.width, self.vocab_size), initializer=init,
          name="reverse_kernel")

  def call(self, inputs, reverse=False):
    if reverse:
      kernel = (ops.transpose(self.embeddings) if self.tied
                else self.reverse_kernel)
      return ops.matmul(inputs, ops.cast(kernel, inputs.dtype))
    return ops.take(self.embeddings, ops.cast(inputs, "int32"), axis=0)

  def compute_output_spec(self, inputs, reverse=False):
    shape = tuple(inputs.shape)
    if reverse:
      return keras.KerasTensor(shape[:-1] + (self.vocab_size,),
                               dtype=self.compute_dtype)
    return keras.KerasTensor(shape + (self.width,), dtype=self.compute_dtype)

  def get_config(self):
    return {**super().get_config(), "vocab_size": self.vocab_size,
            "width": self.width, "tied": self.tied}


class PositionEmbedding(keras.layers.Layer):
  """Learned position vectors [sequence_length, width], added to `x`."""

  def __init__(self, sequence_length, width, **kwargs):
    super().__init__(**kwargs)
    self.sequence_length, self.width = sequence_length, width

  def build(self, input_shape=None):
    self.positions = self.add_weight(
        shape=(self.sequence_length, self.width),
        initializer=keras.initializers.RandomNormal(stddev=0.02),
        name="positions")

  def call(self, x):
    length = ops.shape(x)[1]
    return x + ops.cast(self.positions[:length], x.dtype)

  def get_config(self):
    return {**super().get_config(), "sequence_length": self.sequence_length,
            "width": self.width}


def _check(name, value, minimum=1):
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ConfigError(f"gpt {name}={value!r} must be an integer >= "
                      f"{minimum}")


def training_flops_per_example(model):
  """nanoGPT's estimate of a training step's FLOPs for one sequence of the
  (unsplit) GPT `model`: T x (6 N + 12 L H Q T)
  (`framework.perf.flops.transformer_flops_per_token`), N its weights less
  the position table and, untied, the token table (a lookup, no matmul)."""
  embedding = model.get_layer("token_embedding")
  positions = model.get_layer("position_embedding")
  blocks = [layer for layer in model.layers if isinstance(layer, Block)]
  params = sum(int(math.prod(w.shape)) for w in model.trainable_weights)
  params -= int(math.prod(positions.positions.shape))
  if not embedding.tied:
    params -= int(math.prod(embedding.embeddings.shape))
  length = positions.sequence_length
  return length * flops.transformer_flops_per_token(
      params, len(blocks), positions.width, length)


@register("gpt", task="language_model", flops=training_flops_per_example)
def build(input_shape, num_classes, *,
          num_layers=default(ModelOptions, "num_layers"),
          num_heads=default(ModelOptions, "num_heads"),
          model_width=default(ModelOptions, "model_width"),
          vocab_size=default(ModelOptions, "vocab_size"),
          tie_embeddings=default(ModelOptions, "tie_embeddings"), mlp_ratio=4):
  """A GPT decoder over token sequences; outputs next-token logits.

  Args:
    input_shape: `(sequence_length,)`: tokens per example (the position
      table's length).
    num_classes: the vocabulary (256 for byte tokens).
    num_layers, num_heads, model_width: blocks, heads per block, width.
    vocab_size: 0: `num_classes`; otherwise it must equal it.
    tie_embeddings: the output head is the token table, transposed.
    mlp_ratio: the MLP's hidden width is `mlp_ratio * model_width`.
  """
  if len(tuple(input_shape)) != 1:
    raise ConfigError(f"gpt takes token sequences [sequence_length]; got "
                      f"input_shape={tuple(input_shape)} (use a text "
                      "dataset, e.g. --dataset=text)")
  (length,) = tuple(input_shape)
  for name, value in (("num_layers", num_layers), ("num_heads", num_heads),
                      ("model_width", model_width), ("mlp_ratio", mlp_ratio),
                      ("sequence_length", length)):
    _check(name, value)
  _check("vocab_size", vocab_size, minimum=0)
  if vocab_size and vocab_size != num_classes:
    raise ConfigError(f"gpt vocab_size={vocab_size} differs from the "
                      f"dataset's {num_classes} tokens; leave it 0 (the "
                      "dataset's) or match it")
  vocab = vocab_size or num_classes
  if model_width % num_heads:
    raise ConfigError(f"gpt model_width={model_width} is not divisible by "
                      f"num_heads={num_heads}; use a multiple of it")
  tokens = keras.Input((length,), dtype="int32", name="tokens")
  embedding = ReversibleEmbedding(vocab, model_width, tied=tie_embeddings,
                                  name="token_embedding")
  x = PositionEmbedding(length, model_width,
                        name="position_embedding")(embedding(tokens))
  for i in range(num_layers):
    x = Block(model_width, num_heads, mlp_ratio * model_width,
              name=f"block_{i}")(x)
  x = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")(x)
  logits = embedding(x, reverse=True)
  return keras.Model(tokens, logits, name="gpt")
