"""Weight decay by parameter group, as language-model recipes set it.

An optimizer with a decoupled weight decay (AdamW, or any Keras optimizer
given `weight_decay`) decays only matmul and convolution kernels: variables
of 2 or more dimensions that are not embedding tables (nanoGPT's groups,
with its embeddings left undecayed). Biases, norm scales and offsets (1-D)
and embeddings keep their values where the gradient is zero. A pattern
(`weight_decay_exclude`) replaces that rule: the variables whose path
matches it are the undecayed ones.

The groups are set on the optimizer through Keras's own
`exclude_from_weight_decay(var_list=...)`, which `Trainer.update_variable`
reads for every variable it updates. Variables updated in a variable's
place follow it: ZeRO-1's shards (`optimizer_sharding`) and a mesh's
copies, each with its own optimizer (`model_parallel`); a tensor split's
pieces (`kernel_shard_0`) are grouped by the path they were cut from.
"""

import re

from absl import logging

from framework import _tf_internal

# What a tensor split appends to a variable's name (`model_parallel`).
_SPLIT_SUFFIX = re.compile(r"_shard_\d+$")
# Embedding tables by variable name: Keras `Embedding`'s and the GPT's token
# (`embeddings`) and position (`positions`) tables.
EMBEDDING_NAMES = ("embeddings", "positions")


def path(variable):
  """The variable's path (`block_0/mlp/fc/kernel`), a tensor split's piece
  named as the variable it was cut from."""
  name = getattr(variable, "path", None) or variable.name.split(":")[0]
  return _SPLIT_SUFFIX.sub("", name)


def decayed(variable, exclude=None):
  """Whether weight decay applies to `variable` by default (`exclude`
  None: 2-D or more and no embedding table) or under the pattern
  `exclude` (not decayed where it matches the path)."""
  where = path(variable)
  if exclude is not None:
    return re.search(exclude, where) is None
  return (len(variable.shape) >= 2
          and where.rsplit("/", 1)[-1] not in EMBEDDING_NAMES)


def has_weight_decay(optimizer):
  return bool(getattr(optimizer, "weight_decay", None))


def group(optimizer, variables, exclude=None, *, decisions=None,
          followers=()):
  """Sets `optimizer`'s weight-decay groups; returns whether each of
  `variables` is decayed.

  Args:
    optimizer: a Keras optimizer; nothing changes without `weight_decay`.
    variables: the variables it updates.
    exclude: None (the default groups) or a pattern (see `decayed`).
    decisions: decided already (a copy's optimizer follows copy 0's):
      `variables[i]` is decayed where `decisions[i]`.
    followers: lists aligned with `variables` of variables updated in their
      place (ZeRO-1 shards), grouped with them.
  """
  if decisions is None:
    # What the optimizer excluded itself stays excluded.
    decisions = [_tf_internal.uses_weight_decay(optimizer, v)
                 and decayed(v, exclude) for v in variables]
  decisions = list(decisions)
  if has_weight_decay(optimizer):
    out = [v for v, keep in zip(variables, decisions) if not keep]
    for follower in followers:
      out += [f for f, keep in zip(follower, decisions) if not keep]
    optimizer.exclude_from_weight_decay(var_list=out)
  return decisions


def log_groups(optimizer, variables, decisions):
  """One line each: the decayed variables and the others, by path."""
  if not has_weight_decay(optimizer):
    return
  for keep, label in ((True, "decayed"), (False, "not decayed")):
    paths = [path(v) for v, d in zip(variables, decisions) if d == keep]
    logging.info("weight decay %g, %s (%d): %s",
                 float(optimizer.weight_decay), label, len(paths),
                 ", ".join(dict.fromkeys(paths)) or "none")
