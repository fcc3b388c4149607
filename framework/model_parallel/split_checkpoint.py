"""A split model's optimizer, checkpointed under the unsplit model's keys.

Keras keeps an optimizer's per-variable state in lists indexed by the
variables it was built on (the first moment of variable 3 is element 3 of
one list, and the flat list of all its variables interleaves them), and a
checkpoint stores each by that index. A tensor split trains other
variables (each cut weight is D shards), so its optimizer alone would
write other indices and shapes than an unsplit run's: a run resumed on
another mesh, or on none, would fail on a shape or, where shapes agree,
restore another variable's slots.

`unsplit_view` is the object graph an unsplit run's optimizer has: the
same children, each per-variable list in the unsplit model's variable
order, each cut slot one whole tensor (a `ShardedWeight` over its shards'
slots, joined at save and cut again at restore), the model's weights the
split's own `ShardedWeight`s. A checkpoint of any mesh then restores into
any other, and the optimizer state with it.
"""

import keras
import tensorflow as tf

from framework import _tf_internal
from framework.model_parallel.parallel_layers import (CheckpointNode,
                                                      ShardedWeight)


def _is_variable(value):
  return isinstance(value, (keras.Variable, tf.Variable))


def _is_list(value):
  """A list the optimizer tracks (Keras wraps lists for checkpoints)."""
  return (not _is_variable(value) and not hasattr(value, "keys") and
          hasattr(value, "__iter__") and hasattr(value, "__len__"))


def _shadow(optimizer, variables):
  """An optimizer of `optimizer`'s kind and settings built on `variables`:
  the layout an unsplit run's optimizer has (only its structure is read).
  Its learning rate is a variable exactly where `optimizer`'s is (a
  schedule is not one), so that the flat variable lists line up."""
  rate = (0.0 if _tf_internal.learning_rate_variable(optimizer) is not None
          else keras.optimizers.schedules.ExponentialDecay(0.0, 1, 1.0))
  shadow = type(optimizer).from_config(dict(optimizer.get_config(),
                                            learning_rate=rate))
  shadow.build(list(variables))
  return shadow


def unsplit_view(optimizer, unsplit_variables, split_weights, *,
                 state=None, index=None):
  """The checkpoint view of a split model's built `optimizer`.

  Args:
    optimizer: the optimizer built on the split model's trainable
      variables.
    unsplit_variables: the unsplit model's trainable variables, in the
      order an unsplit run builds its optimizer on.
    split_weights: for each of them, the split model's weight: a variable,
      or a `ShardedWeight` over its shard variables.
    state, index: where the optimizer's state is checkpointed from, if not
      `optimizer` itself: a view with its children (the data axis's ZeRO-1
      view, `copy_sharding`, whose slots save whole), and `index(variable)`,
      a split variable's position in its per-variable lists.

  Returns:
    A trackable to checkpoint as `optimizer`.

  Raises:
    ValueError: the optimizer's state does not line up with the weights.
  """
  unsplit_variables = list(unsplit_variables)
  split_weights = list(split_weights)
  if len(split_weights) != len(unsplit_variables):
    raise ValueError(f"{len(split_weights)} split weights for "
                     f"{len(unsplit_variables)} unsplit variables")
  split_count = sum(len(w.shards) if isinstance(w, ShardedWeight) else 1
                    for w in split_weights)
  shadow = _shadow(optimizer, unsplit_variables)
  mine = _tf_internal.trackable_children(
      optimizer if state is None else state)
  theirs = _tf_internal.trackable_children(shadow)
  if index is None:
    index = lambda v: _tf_internal.optimizer_variable_index(optimizer, v)

  def piece(values, weight):
    if isinstance(weight, ShardedWeight):
      return ShardedWeight([values[index(s)] for s in weight.shards],
                           weight.axis)
    return values[index(weight)]

  # id(a shadow variable) -> what the view saves in its place.
  found = {}
  children = {}
  for name, child in theirs.items():
    own = mine.get(name)
    if _is_variable(child):
      if own is None:
        raise ValueError(f"the split optimizer has no {name}")
      found[id(child)] = children[name] = own
    elif (_is_list(child) and len(child) == len(unsplit_variables)
          and own is not None and len(own) == split_count):
      entries = []
      for value, variable, weight in zip(child, unsplit_variables,
                                         split_weights):
        # The variables themselves (the list they were built on), or a
        # per-variable slot.
        entry = weight if value is variable else piece(own, weight)
        found[id(value)] = entry
        entries.append(entry)
      children[name] = _Node(entries)
  for name, child in theirs.items():
    if name in children:
      continue
    if _is_list(child):
      missing = [getattr(v, "path", v) for v in child if id(v) not in found]
      if missing:
        raise ValueError(f"optimizer state {missing[:3]} has no counterpart "
                         "in the split optimizer")
      children[name] = _Node([found[id(v)] for v in child])
    else:  # e.g. Keras's dict of variable indices (no variables in it)
      children[name] = mine.get(name, child)
  # The shadow's order: a checkpoint keys each value by its first path.
  return _Node({name: children[name] for name in theirs})


class _Node(CheckpointNode):
  """A checkpoint node with the given children, in order (a list's are
  named `0`, `1`, ..., as Keras's tracked lists name theirs)."""

  def __init__(self, children):
    if not hasattr(children, "keys"):
      children = {str(i): child for i, child in enumerate(children)}
    self.children = dict(children)

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    return dict(self.children)
