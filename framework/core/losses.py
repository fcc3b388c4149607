"""Per-example losses for `Trainer(loss_fn=...)`.

A Trainer averages per-example losses over the *global* batch itself (see
`Trainer.average`), so these return one value per example (or per pixel) and
never reduce: a Keras loss object would divide by the replica count.
"""

import tensorflow as tf

from framework.errors import ConfigError


def smoothed_sparse_categorical_loss(label_smoothing):
  """`(labels, logits) -> per-example cross-entropy` with label smoothing.

  The target is `(1 - s) * one_hot(label) + s / K` over the K classes, as in
  `keras.losses.CategoricalCrossentropy(label_smoothing=s)` on one-hot
  labels, computed in float32 from integer labels of any shape (one per
  example, or one per pixel):

      loss = -(1 - s) * log_softmax(logits)[label] - s/K * sum(log_softmax)

  Args:
    label_smoothing: s in [0, 1); 0 is the plain sparse cross-entropy.
  """
  if not 0 <= label_smoothing < 1:
    raise ConfigError(f"label_smoothing={label_smoothing} must be in [0, 1)")
  smoothing = float(label_smoothing)

  def loss_fn(labels, logits):
    log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32), axis=-1)
    labels = tf.cast(labels, tf.int32)
    if labels.shape.rank == log_probs.shape.rank:  # [..., 1] labels
      labels = tf.squeeze(labels, -1)
    true_term = -tf.gather(log_probs, labels[..., None], axis=-1,
                           batch_dims=labels.shape.rank)[..., 0]
    uniform_term = -tf.reduce_mean(log_probs, axis=-1)
    return (1.0 - smoothing) * true_term + smoothing * uniform_term

  loss_fn.label_smoothing = smoothing
  return loss_fn
