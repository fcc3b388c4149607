"""How the step's one gradient all-reduce goes over the wire.

    config = AllReduceConfig(bytes_per_pack=4 << 20, implementation="ring",
                             dtype="bfloat16")
    Trainer(..., all_reduce=config)

- `bytes_per_pack`, `implementation`: TensorFlow's
  `tf.distribute.experimental.CommunicationOptions`. The collective
  all-reduce (MultiWorkerMirroredStrategy) concatenates the gradients into
  packs of about `bytes_per_pack` bytes, one collective per pack (0: one
  pack for everything, TensorFlow's default); several packs can be in
  flight at once. `implementation`: `ring` (gRPC, CPU and GPU), `nccl`
  (GPUs only) or `auto` (TensorFlow chooses). The sum is the same either
  way; strategies without collectives (mirrored and central storage on
  CPU, parameter server) ignore both.
- `dtype="bfloat16"`: float32 gradients are rounded to bfloat16 before the
  reduction and cast back after it, so the wire carries half the bytes;
  the update is applied in float32. Each reduced value is the float32 sum
  within a relative error of about (replicas + 1) x 2^-8 (bfloat16 keeps 8
  significant bits).
"""

import dataclasses

import tensorflow as tf

from framework.errors import ConfigError, check_choice

IMPLEMENTATIONS = ("auto", "ring", "nccl")
DTYPES = ("float32", "bfloat16")

_IMPLEMENTATION = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


@dataclasses.dataclass(frozen=True)
class AllReduceConfig:
  """The gradient all-reduce's packing, implementation and wire dtype.

  Attributes:
    bytes_per_pack: pack size in bytes, >= 0 (0: one pack).
    implementation: one of IMPLEMENTATIONS.
    dtype: one of DTYPES: the dtype float32 gradients have on the wire.
  """
  bytes_per_pack: int = 0
  implementation: str = "auto"
  dtype: str = "float32"

  def __post_init__(self):
    if (isinstance(self.bytes_per_pack, bool)
        or not isinstance(self.bytes_per_pack, int)
        or self.bytes_per_pack < 0):
      raise ConfigError(f"all_reduce_bytes_per_pack={self.bytes_per_pack!r} "
                        "must be an integer >= 0 (0: one pack)")
    check_choice("all_reduce_implementation", self.implementation,
                 IMPLEMENTATIONS)
    check_choice("all_reduce_dtype", self.dtype, DTYPES)

  @property
  def is_default(self):
    return self == AllReduceConfig()

  def options(self):
    """The `tf.distribute.experimental.CommunicationOptions`."""
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=self.bytes_per_pack,
        implementation=_IMPLEMENTATION[self.implementation])


def all_reduce_sum(context, values, config=None):
  """SUM of `values` (a nest of tensors) over the replicas of `context` (a
  `tf.distribute.ReplicaContext`), in one all-reduce call, as `config`
  says (None: TensorFlow's defaults)."""
  sum_op = tf.distribute.ReduceOp.SUM
  if config is None or config.is_default:
    return context.all_reduce(sum_op, values)
  flat = tf.nest.flatten(values)
  if config.dtype == "bfloat16":
    wire = [tf.cast(v, tf.bfloat16) if v.dtype == tf.float32 else v
            for v in flat]
  else:
    wire = flat
  reduced = context.all_reduce(sum_op, wire, options=config.options())
  reduced = [tf.cast(r, v.dtype) if r.dtype != v.dtype else r
             for r, v in zip(reduced, flat)]
  return tf.nest.pack_sequence_as(values, reduced)
