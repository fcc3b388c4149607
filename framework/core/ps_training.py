"""Asynchronous parameter-server stepping, behind the Controller's protocol.

Under `ParameterServerStrategy` the chief is a coordinator: variables live on
the `ps` tasks, `worker` tasks run whatever the coordinator schedules, and
every worker applies its own updates as soon as it has them (no all-reduce).
The outer loop is the same `Controller` as for every other strategy; only
`train(iterator, n)` differs, so a parameter-server run writes the same
checkpoints, summaries, model_info.json, weights and export:

    CoordinatedTrainer.train(iterator, n):       # iterator: per-worker data
      limit = global_step + n
      schedule n closures, each
        claim = global_step.assign_add(1)        # on the ps
        if claim <= limit: one train_step on that worker's batch
        else: global_step.assign_sub(1)          # too many in flight
      join; return the mean metrics of the closures that trained

The claim makes each loop end at exactly `limit` even when a failed worker's
closure is run again elsewhere (a closure can run twice: the step is a
variable, not a count of scheduled closures). Batches come from a per-worker
dataset (in memory, each worker draws its own order; from files, each
worker streams its own shards): asynchronous training has no single global
order, so PS runs resume from the checkpointed step but not bit-exactly.
Evaluation runs on the coordinator.
"""

import tensorflow as tf

from framework import _tf_internal
from framework.data import inputs
from framework.data.config import InputConfig
from framework.errors import ConfigError
from framework.settings import default

SUM = tf.distribute.ReduceOp.SUM


def is_parameter_server(strategy):
  return isinstance(strategy,
                    tf.distribute.experimental.ParameterServerStrategy)


def check_config(config):
  """ConfigError for what an `ExperimentConfig` asks that PS cannot do."""
  loop = config.loop
  if loop is not None and loop.profile_steps:
    raise ConfigError(
        f"profile_steps={','.join(map(str, loop.profile_steps))} is not "
        "supported under strategy=parameter_server: the steps run on the "
        "workers (trace one with tf.profiler.experimental.client.trace)")
  if config.input_mode != "global":
    raise ConfigError(
        f"input_mode={config.input_mode} is not supported under "
        "strategy=parameter_server: each worker always builds its own input "
        "pipeline (use input_mode=global)")
  # Both skip an update with a tf.cond around Trainer's variable updates,
  # which under ParameterServerStrategy fails to trace (merge_call inside a
  # cond branch).
  if config.mixed_precision == "float16":
    raise ConfigError(
        "mixed_precision=float16 is not supported under "
        "strategy=parameter_server: its loss scaling skips overflowing "
        "updates, which the workers cannot (use mixed_precision=bfloat16)")
  if config.nan_policy == "skip":
    raise ConfigError(
        "nan_policy=skip is not supported under strategy=parameter_server: "
        "the workers cannot skip an update (use nan_policy=stop, clip_norm "
        "or a lower learning_rate)")
  if config.spike_policy != "none":
    raise ConfigError(
        f"spike_policy={config.spike_policy} is not supported under "
        "strategy=parameter_server: the workers cannot skip an update (use "
        "spike_policy=none, clip_norm or a lower learning_rate)")
  if config.model_parallel.mode != "none":
    raise ConfigError(
        f"model_parallel={config.model_parallel.mode} is not supported "
        "under strategy=parameter_server (use strategy=default or "
        "one_device)")


def per_worker_dataset_fn(dataset, global_batch_size, *,
                          seed=default(InputConfig, "seed"), augment=None):
  """A dataset function for `create_per_worker_dataset`.

  Each worker shuffles with its own seed (drawn when the worker builds the
  dataset), so workers do not train on the same batches at the same time.
  `global_batch_size` is the batch of one step of one worker.
  """

  def dataset_fn():
    worker_seed = tf.cast(tf.timestamp() * 1e6, tf.int64) + seed
    # pylint: disable=protected-access
    ds = inputs._index_batches(len(dataset.train_x), global_batch_size,
                               worker_seed, 0)
    ds = ds.map(inputs._gather_fn(dataset, worker_seed, augment),
                num_parallel_calls=tf.data.AUTOTUNE)
    # pylint: enable=protected-access
    return ds.prefetch(tf.data.AUTOTUNE)

  return dataset_fn


class CoordinatedTrainer:
  """A Trainer whose steps the coordinator schedules on the PS workers.

  Defines `train`, `evaluate` and `distribute_dataset` itself; forwards
  exactly `FORWARDED` to the wrapped trainer, whose `train_step` and
  `eval_step` are the math: the loop contract's attributes
  (`framework.core.protocols`), each only where the wrapped trainer has it,
  so that this object has the optional names the trainer has.

  Args:
    trainer: a `Trainer` built under a `ParameterServerStrategy`.
  """

  # Read on the wrapped trainer each time (`LoopTrainer`'s attributes).
  REQUIRED = ("model", "optimizer", "strategy", "global_step")
  # Copied from it when it has them: fixed objects (variables, policies,
  # bound methods); `last_confusion` is refreshed after each evaluation.
  OPTIONAL = ("sync_replica_state", "global_batch_size", "nan_policy",
              "max_skipped_steps", "skipped_steps", "consecutive_skips",
              "loss_scale", "request_stop", "stop_requested",
              "run_eval_step", "metric_aliases", "export_model", "ema",
              "averaged_weights", "last_confusion", "checkpointed_optimizer",
              "tracked_objects", "spikes", "collective_wait_seconds")
  FORWARDED = REQUIRED + OPTIONAL

  def __init__(self, trainer):
    if not is_parameter_server(trainer.strategy):
      raise ConfigError(
          f"CoordinatedTrainer needs a ParameterServerStrategy trainer; got "
          f"{type(trainer.strategy).__name__}")
    self._forward(trainer)
    self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
        trainer.strategy)
    self._step_fn = tf.function(self._claimed_step)
    self._eval_fn = tf.function(self._eval_batch)
    self._last_metrics = None

  def _forward(self, trainer):
    """Wraps `trainer`: its `OPTIONAL` attributes that it has, copied."""
    self.trainer = trainer
    for name in self.OPTIONAL:
      if hasattr(trainer, name):
        setattr(self, name, getattr(trainer, name))
    if not hasattr(trainer, "sync_replica_state"):
      self.sync_replica_state = lambda: None

  model = property(lambda self: self.trainer.model)
  optimizer = property(lambda self: self.trainer.optimizer)
  strategy = property(lambda self: self.trainer.strategy)
  global_step = property(lambda self: self.trainer.global_step)

  def per_worker_dataset(self, dataset_fn):
    """The distributed dataset `train` iterates: `dataset_fn` per worker."""
    return self.coordinator.create_per_worker_dataset(dataset_fn)

  def _claimed_step(self, iterator, limit):
    """One step on a worker, if the step counter is still below `limit`."""
    trainer, strategy = self.trainer, self.trainer.strategy
    claim = trainer.global_step.assign_add(1, read_value=True)
    structure = {}

    def train():
      per_replica = strategy.run(trainer.train_step, args=(next(iterator),))
      metrics = {k: strategy.reduce(SUM, v, axis=None)
                 for k, v in per_replica.items()}
      metrics["trained"] = tf.constant(1.0)
      structure.update(metrics)
      return metrics

    def give_back():
      # Traced after `train` (cond_v2 traces the true branch first), so the
      # metric names and dtypes are known here.
      with tf.control_dependencies([trainer.global_step.assign_sub(1)]):
        return {k: tf.zeros(v.shape, v.dtype) for k, v in structure.items()}

    return tf.cond(claim <= limit, train, give_back)

  def train(self, iterator, num_steps):
    """Runs `num_steps` steps on the workers; returns their mean metrics."""
    start = int(self.trainer.global_step.numpy())
    limit = tf.constant(start + num_steps, tf.int64)
    remote = [self.coordinator.schedule(self._step_fn, args=(iterator, limit))
              for _ in range(num_steps)]
    self.coordinator.join()
    if int(self.trainer.global_step.numpy()) > start + num_steps:
      # A closure that claimed past the limit and then lost its worker
      # never gave its claim back; nothing is in flight after `join`.
      self.trainer.global_step.assign(start + num_steps)
    fetched = [r.fetch() for r in remote]
    trained = [m for m in fetched if m["trained"] > 0]
    if trained:
      self._last_metrics = {
          k: float(sum(m[k] for m in trained) / len(trained))
          for k in trained[0] if k != "trained"}
    elif self._last_metrics is None:
      # Every closure's claim was taken by a retried one that lost its
      # worker (the first loop, so no earlier metrics): report zeros rather
      # than a NaN loss that would stop the run.
      return {k: 0.0 for k in fetched[0] if k != "trained"}
    return dict(self._last_metrics)

  def _eval_batch(self, batch):
    return {k: tf.cast(v, tf.float64)
            for k, v in self.trainer.run_eval_step(batch).items()}

  def distribute_dataset(self, dataset):
    """Eval datasets stay plain: the coordinator runs them itself."""
    return dataset

  def evaluate(self, dataset):
    """Evaluates on the coordinator over `dataset` (a plain tf.data one,
    of `MaskedBatch`es: full batches, padding masked out of the sums)."""
    totals = None
    for batch in dataset:
      values = {k: v.numpy() for k, v in self._eval_fn(batch).items()}
      totals = values if totals is None else {
          k: totals[k] + values[k] for k in totals}
    results = {k: float(v) for k, v in
               self.trainer.eval_results(totals).items()}
    if "last_confusion" in vars(self):
      self.last_confusion = self.trainer.last_confusion
    return results


def coordinate(trainer, dataset, global_batch_size, *,
               seed=default(InputConfig, "seed"), augment=None):
  """(CoordinatedTrainer, train_input, eval_input) for the Controller.

  `train_input(start_step)` gives the per-worker datasets (in memory, each
  worker draws its own order, so `start_step` only matters to the step
  counter; from files, worker i reads its own shards, from its share of
  `start_step` on); `eval_input()` the whole test set, evaluated on the
  coordinator.
  """
  coordinated = CoordinatedTrainer(trainer)
  if hasattr(dataset, "per_worker_train_dataset_fn"):
    # Files (framework/data/file_input.py): worker i streams its own shards.
    # Set when the strategy connects (its public `cluster_resolver` is None).
    num_workers = _tf_internal.num_workers(trainer.strategy)

    def train_input(start_step):
      return coordinated.per_worker_dataset(
          dataset.per_worker_train_dataset_fn(
              num_workers, global_batch_size, seed=seed,
              start_step=start_step, augment=augment))

    def eval_input():
      return dataset.eval_dataset(global_batch_size)

    return coordinated, train_input, eval_input

  dataset_fn = per_worker_dataset_fn(dataset, global_batch_size, seed=seed,
                                     augment=augment)

  def train_input(start_step):
    del start_step  # asynchronous: no global order to resume
    return coordinated.per_worker_dataset(dataset_fn)

  def eval_input():
    return inputs.eval_dataset(dataset.test_x, dataset.test_y,
                               global_batch_size)

  return coordinated, train_input, eval_input
