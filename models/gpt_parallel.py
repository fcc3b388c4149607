"""The GPT of `models/gpt.py`, tensor-parallel over D shard devices.

The same layers (`Block`, `CausalSelfAttention`, `MLP`) built with
`devices=`; the token table and the output head cut by vocabulary
(`VocabParallelEmbedding`); layer norms, position table and row-parallel
biases replicated (one variable on devices[0], read on every device). The
residual stream is one copy per device:

    x_d = all_reduce(lookup_d(tokens)) + positions        per device d
    x   = block.split_call(x)                             per block
    logits_d = head_d(ln_f(x_d))                          [B, T, V/D]

Tensor x pipeline (`tensor_stages=P`): `devices` is P groups of D, stage p
holding blocks `p * L/P ...` cut across its own D devices (their
all-reduces within that group only); the embedding and positions live on
stage 0, the last layer norm and the head on stage P-1 (a tied head
reads stage 0's table shards). The residual stream crosses from one
stage's device d to the next stage's device d.

Weights sit under the unsplit model's checkpoint paths (`_operations/i/`),
cut weights as slices of the full tensor, so a checkpoint of either
restores into the other.
"""

import keras
import tensorflow as tf

from framework.errors import ConfigError
from framework.model_parallel import parallel_layers
from framework.model_parallel.config import SplitConfig, register_split
from framework.settings import default
from models import gpt


def _weights(embedding, position, blocks, ln_f):
  """The logical weights of a GPT, in one order for split and unsplit."""
  weights = [embedding.embeddings]
  if not embedding.tied:
    weights.append(embedding.reverse_kernel)
  weights.append(position.positions)
  for block in blocks:
    weights += [block.ln1.gamma, block.ln1.beta, block.ln2.gamma,
                block.ln2.beta]
    for dense in (block.attention.query, block.attention.key,
                  block.attention.value, block.attention.out, block.mlp.fc,
                  block.mlp.proj):
      weights += [dense.kernel, dense.bias]
  return weights + [ln_f.gamma, ln_f.beta]


def _unsplit_parts(model):
  blocks = [layer for layer in model.layers if isinstance(layer, gpt.Block)]
  return (model.get_layer("token_embedding"),
          model.get_layer("position_embedding"), blocks,
          model.get_layer("ln_f"))


def logical_weights(model):
  """The unsplit GPT `model`'s weights in `ShardedGPT.logical_weights`
  order."""
  return _weights(*_unsplit_parts(model))


class _Slot(keras.layers.Layer):
  """Stands where the unsplit model's input layer is (`_operations/0`)."""


class _Operations(parallel_layers.CheckpointNode):
  """The layers as the unsplit Functional model lists them: children
  `0`, `1`, ... (its `_operations` list in a checkpoint)."""

  def __init__(self, layers):
    self.layers = list(layers)

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    return {str(i): layer for i, layer in enumerate(self.layers)}


class ShardedGPT(keras.Model):
  """A GPT whose blocks, embedding and head are cut across `devices`
  (`tensor_stages` consecutive groups of them: tensor x pipeline)."""

  def __init__(self, *, sequence_length, vocab_size, width, num_heads,
               hidden, num_layers, tied, devices,
               tensor_stages=default(SplitConfig, "tensor_stages"), **kwargs):
    super().__init__(name="gpt", **kwargs)
    self.devices = tuple(devices)
    self.tensor_stages = tensor_stages
    self.options = dict(sequence_length=sequence_length,
                        vocab_size=vocab_size, width=width,
                        num_heads=num_heads, hidden=hidden,
                        num_layers=num_layers, tied=tied,
                        tensor_stages=tensor_stages)
    self.stage_devices = stage_groups(self.devices, tensor_stages)
    first, last = self.stage_devices[0], self.stage_devices[-1]
    self.embedding = parallel_layers.VocabParallelEmbedding(
        vocab_size, width, first, tied=tied, name="token_embedding")
    self.position = gpt.PositionEmbedding(sequence_length, width,
                                          name="position_embedding")
    self.blocks = [gpt.Block(width, num_heads, hidden,
                             self.stage_devices[stage_of(i, num_layers,
                                                         tensor_stages)],
                             name=f"block_{i}") for i in range(num_layers)]
    self.ln_f = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")
    # Built eagerly, piece by piece: a device scope inside a symbolic call
    # does not reach the variables Keras creates there.
    shape = (None, sequence_length, width)
    self.embedding.build()
    with tf.device(first[0]):
      self.position.build(shape)
    with tf.device(last[0]):
      self.ln_f.build(shape)
    for block in self.blocks:
      block.build(shape)
    # The unsplit Functional model's checkpoint paths.
    self.checkpoint_layers = _Operations(
        [_Slot(name="tokens"), self.embedding, self.position, *self.blocks,
         self.ln_f])
    self.built = True

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    # Only the unsplit model's paths: `_operations/<i>/...`.
    return {"_operations": self.checkpoint_layers}

  def logical_weights(self):
    """The weights in the unsplit model's logical order (see `_weights`)."""
    return _weights(self.embedding, self.position, self.blocks, self.ln_f)

  def call(self, tokens, training=False):
    devices = self.stage_devices[0]
    looked_up = [parallel_layers.on_device(
        device, lambda d=d: self.embedding.lookup(d, tokens))
                 for d, device in enumerate(devices)]
    xs = [parallel_layers.on_device(device, self.position, x) for device, x in
          zip(devices, parallel_layers.all_reduce(looked_up, devices))]
    for block in self.blocks:
      xs = block.split_call(xs)  # on_device moves xs to the block's stage
    devices = self.stage_devices[-1]
    return [parallel_layers.on_device(
        device, lambda x, d=d: self.embedding.logits(d, self.ln_f(x)), x)
            for d, (device, x) in enumerate(zip(devices, xs))]

  def checkpoint_weights(self, model):
    """For each trainable variable of the unsplit `model`, in its order,
    this split's weight at the same place (a variable or a
    `ShardedWeight`): what the optimizer's checkpoint view pairs."""
    mine = dict(zip(map(id, logical_weights(model)), self.logical_weights()))
    return [mine[id(v)] for v in model.trainable_variables]

  def load_weights_from(self, model):
    """Sets the shards from the unsplit `model` (or another ShardedGPT)."""
    source = (model.logical_weights() if isinstance(model, ShardedGPT)
              else logical_weights(model))
    for mine, theirs in zip(self.logical_weights(), source):
      mine.assign(theirs.numpy())
    return self

  def save_weights_to(self, model):
    """Writes the shards, joined, into the unsplit `model`."""
    for mine, theirs in zip(self.logical_weights(), logical_weights(model)):
      theirs.assign(mine.numpy())
    return model

  def replicate(self, devices):
    """Another ShardedGPT on `devices`, with these weights."""
    return ShardedGPT(**self.options, devices=devices).load_weights_from(self)


def stage_groups(devices, tensor_stages):
  """`devices` cut into `tensor_stages` consecutive groups of equal size."""
  size = len(devices) // tensor_stages
  return [tuple(devices[p * size:(p + 1) * size])
          for p in range(tensor_stages)]


def stage_of(block, num_layers, tensor_stages):
  """The stage of block `block`: contiguous, as equal as the count allows."""
  return block * tensor_stages // num_layers


@register_split("gpt")
def split(model, devices,
          tensor_stages=default(SplitConfig, "tensor_stages")):
  """The ShardedGPT of the unsplit GPT `model` on `devices`, its weights.

  With `tensor_stages` (the keyword its caller
  `tensor_parallel.split_setup` passes) > 1, `devices` is that many
  groups of shard devices (tensor x pipeline): stage p's blocks are cut
  across group p.

  Raises:
    ConfigError: the shard count does not divide the heads or the vocabulary,
      or fewer blocks than stages (before any variable is made).
  """
  embedding, position, blocks, _ = _unsplit_parts(model)
  if not blocks:
    raise ConfigError("a tensor split of model=gpt needs at least one block")
  if tensor_stages < 1 or len(devices) % tensor_stages:
    raise ConfigError(f"tensor_stages={tensor_stages} must divide the "
                      f"{len(devices)} devices of a tensor x pipeline split")
  if len(blocks) < tensor_stages:
    raise ConfigError(f"tensor_stages={tensor_stages} needs at least as many "
                      f"gpt blocks; num_layers={len(blocks)}")
  head = blocks[0]
  num = len(devices) // tensor_stages
  parallel_layers.check_divides(num, num_heads=head.num_heads,
                                vocab_size=embedding.vocab_size)
  parallel_layers.check_divides(num, mlp_hidden=head.hidden)
  return ShardedGPT(
      sequence_length=position.sequence_length,
      vocab_size=embedding.vocab_size, width=head.width,
      num_heads=head.num_heads, hidden=head.hidden, num_layers=len(blocks),
      tied=embedding.tied, devices=devices,
      tensor_stages=tensor_stages).load_weights_from(model)
