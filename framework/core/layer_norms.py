"""Per-layer gradient norm, weight norm and update/weight ratio in TensorBoard.

`Trainer(log_layer_norms=True)` (`--log_layer_norms`): on the steps that
`summary_every` divides, the default `train_step` writes into
`model_dir/train`, for each layer (the trainable variables grouped by their
path up to the last `/`, e.g. `block_0/mlp/fc`):

    layer_norms/<layer>/grad          ||g||, the gradient that is applied:
                                      all-reduced, float16 scale undone,
                                      after clipping (`clip_norm`)
    layer_norms/<layer>/weight        ||w|| before the update
    layer_norms/<layer>/update_ratio  ||w_after - w_before|| / ||w_before||
                                      (0 for a skipped update)

and `layer_norms_hist/grad`, `.../weight`, `.../update_ratio`: each a
histogram over the layers of that step.

Everything is computed in replica context from the all-reduced gradient and
the weights, which are equal on every replica (under ZeRO-1's
reduce-scatter, each layer's gradient norm from its slices' squares summed
over replicas), so replica 0's summaries (the
only ones `tf.summary` records under MirroredStrategy) are the global
values. Both halves sit in a `tf.cond` on `tf.summary.should_record_summaries()`:
other steps compute only that condition (and keep no copy of the weights),
and a Trainer without the setting gets no op of it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import tensorflow as tf

# Where TensorBoard shows them: one group of scalars per layer, one page of
# histograms.
SCALARS = "layer_norms"
HISTOGRAMS = "layer_norms_hist"
KINDS = ("grad", "weight", "update_ratio")


def layer_of(variable: Any) -> str:
  """The layer path of `variable`: its Keras path (or name) without the
  last component (`mlp/dense_1/kernel` -> `mlp/dense_1`)."""
  path = _path(variable)
  return path.rsplit("/", 1)[0] if "/" in path else path


def _path(variable: Any) -> str:
  return getattr(variable, "path", None) or variable.name.split(":")[0]


def group_by_layer(variables: Sequence[Any]) -> list[tuple[str, list[int]]]:
  """[(layer path, indices of its variables in `variables`)], in the order
  the layers first appear. Two layers of one path (a subclassed model may
  name two layers alike) are two groups, the second `<path>.2`, ...: a
  variable path seen again starts the next one."""
  groups, current = {}, {}  # current: layer path -> (group, paths in it)
  for i, variable in enumerate(variables):
    layer = layer_of(variable)
    name, paths = current.get(layer, (layer, set()))
    if _path(variable) in paths:
      copy = 2
      while f"{layer}.{copy}" in groups:
        copy += 1
      name, paths = f"{layer}.{copy}", set()
    paths.add(_path(variable))
    current[layer] = (name, paths)
    groups.setdefault(name, []).append(i)
  return list(groups.items())


def _norm(tensors):
  return tf.linalg.global_norm(
      [tf.cast(tf.convert_to_tensor(t), tf.float32) for t in tensors])


@contextlib.contextmanager
def recorded(grads: Sequence[Any], variables: Sequence[Any],
             scattered: bool = False):
  """A context around the one update of `variables` with `grads` (the
  applied gradient, in replica context): reads the weights before it and
  writes the summaries after it, on recorded steps only. TensorFlow orders
  the reads and the update of a variable as the code does.

  `scattered`: each of `grads` is this replica's slice of the gradient
  (ZeRO-1's reduce-scatter); each layer's gradient norm is then the square
  root of its slices' squares summed over replicas, one all-reduce of a
  vector per step (a collective cannot sit in the recorded steps' branch).
  """
  variables = list(variables)
  layer_squares = None
  if scattered:
    squares = tf.stack([
        tf.add_n([tf.reduce_sum(tf.square(tf.cast(grads[i], tf.float32)))
                  for i in indices])
        for _, indices in group_by_layer(variables)])
    layer_squares = tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, squares)
  record = tf.summary.should_record_summaries()
  before = tf.cond(
      record, lambda: [tf.identity(v) for v in variables],
      # No copy of the weights on the other steps.
      lambda: [tf.zeros([0], v.dtype) for v in variables])
  yield
  tf.cond(record, lambda: _write(grads, before, variables, layer_squares),
          lambda: tf.constant(False))


def _write(grads, before, variables, layer_squares=None):
  """The summaries of one recorded step (a `tf.cond` branch)."""
  after = [tf.identity(v) for v in variables]
  values = {kind: [] for kind in KINDS}
  layers = group_by_layer(variables)
  for layer, (_, indices) in enumerate(layers):
    weight = _norm([before[i] for i in indices])
    update = _norm([after[i] - before[i] for i in indices])
    grad = (_norm([grads[i] for i in indices]) if layer_squares is None
            else tf.sqrt(layer_squares[layer]))
    layer_values = {"grad": grad,
                    "weight": weight,
                    "update_ratio": tf.math.divide_no_nan(update, weight)}
    values = {kind: values[kind] + [value]
              for kind, value in layer_values.items()}
  # The tags as written, without the branch's name scope (`cond_1/`).
  with tf.compat.v1.name_scope(None):
    for kind, layer_values in values.items():
      for (layer, _), value in zip(layers, layer_values):
        tf.summary.scalar(f"{SCALARS}/{layer}/{kind}", value)
      tf.summary.histogram(f"{HISTOGRAMS}/{kind}", tf.stack(layer_values))
  return tf.constant(True)
