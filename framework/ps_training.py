"""Asynchronous parameter-server training, driven from the coordinator.

Under `ParameterServerStrategy` the chief is a coordinator: variables live on
the `ps` tasks, `worker` tasks run whatever the coordinator schedules, and
every worker applies its own updates as soon as it has them (no all-reduce).

    coordinator = ClusterCoordinator(strategy)
    iterator    = iter(coordinator.create_per_worker_dataset(dataset_fn))
    while step < train_steps:
      schedule min(steps_per_loop, train_steps - step) closures, each
        claim = global_step.assign_add(1)        # on the ps
        if claim <= train_steps: one train_step on that worker's batch
        else: global_step.assign_sub(1)          # too many in flight
      join; step = global_step                   # a variable, not a count of
                                                 # scheduled closures: a
                                                 # closure can run twice
      summaries, logs, checkpoints from the coordinator

The claim makes the final step exact even when a failed worker's closure is
run again elsewhere. Batches come from a per-worker dataset (each worker
draws its own order): asynchronous training has no single global order, so
PS runs resume from the checkpointed step but not bit-exactly.
"""

import math
import time

from absl import logging
import tensorflow as tf

from framework import cluster, inputs
from framework.checkpointing import CheckpointManager
from framework.errors import ConfigError, NonFiniteLossError
from framework.summaries import SummaryWriter, markdown_table

SUM = tf.distribute.ReduceOp.SUM


def per_worker_dataset_fn(dataset, global_batch_size, *, seed=0, augment=None):
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


class ParameterServerController:
  """The coordinator's outer loop (the PS counterpart of `Controller`).

  Args:
    trainer: a `Trainer` built under a `ParameterServerStrategy`.
    config: a `LoopConfig`.
    model_dir: checkpoints; TensorBoard in `train/` and `eval/`.
    dataset_fn: `() -> tf.data.Dataset` of batches, run on each worker.
    eval_dataset: `() -> tf.data.Dataset` evaluated on the coordinator.
    hparams: written once as a text summary.
    on_loop_end: callables `fn(step)` run after each loop.
  """

  def __init__(self, trainer, config, model_dir, *, dataset_fn,
               eval_dataset=None, hparams=None, on_loop_end=()):
    if config.profile_steps:
      raise ConfigError(
          f"profile_steps={config.profile_steps} is not supported under "
          "parameter_server: the steps run on the workers (trace one with "
          "tf.profiler.experimental.client.trace)")
    self.trainer = trainer
    self.config = config
    self.model_dir = model_dir
    self.strategy = trainer.strategy
    self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
        self.strategy)
    self.dataset_fn = dataset_fn
    self.eval_dataset = eval_dataset
    self.hparams = hparams or {}
    self.on_loop_end = list(on_loop_end)
    self.checkpoint = tf.train.Checkpoint(
        model=trainer.model, optimizer=trainer.optimizer,
        global_step=trainer.global_step)
    self.checkpoints = CheckpointManager(
        self.checkpoint, model_dir, self.strategy,
        max_to_keep=config.keep_checkpoints)
    self.train_writer = SummaryWriter(model_dir, "train")
    self.eval_writer = SummaryWriter(model_dir, "eval")
    self._step_fn = tf.function(self._claimed_step)
    self._eval_fn = tf.function(self._eval_batch)
    self.last_eval = None

  @property
  def step(self):
    return int(self.trainer.global_step.numpy())

  def _claimed_step(self, iterator, train_steps):
    """One step on a worker, if the step counter still allows one."""
    trainer = self.trainer
    claim = trainer.global_step.assign_add(1, read_value=True)
    structure = {}

    def train():
      per_replica = self.strategy.run(trainer.train_step,
                                      args=(next(iterator),))
      metrics = {k: self.strategy.reduce(SUM, v, axis=None)
                 for k, v in per_replica.items()}
      metrics["trained"] = tf.constant(1.0)
      structure.update(metrics)
      return metrics

    def give_back():
      # Traced after `train` (cond_v2 traces the true branch first), so the
      # metric names and dtypes are known here.
      with tf.control_dependencies([trainer.global_step.assign_sub(1)]):
        return {k: tf.zeros(v.shape, v.dtype) for k, v in structure.items()}

    return tf.cond(claim <= train_steps, train, give_back)

  def _eval_batch(self, batch):
    return {k: tf.cast(v, tf.float64)
            for k, v in self.trainer.eval_step(batch).items()}

  def evaluate(self):
    """Evaluates on the coordinator over the whole eval set."""
    if self.eval_dataset is None:
      return None
    totals = None
    for batch in self.eval_dataset():
      values = {k: v.numpy() for k, v in self._eval_fn(batch).items()}
      totals = values if totals is None else {
          k: totals[k] + values[k] for k in totals}
    results = {k: float(v) for k, v in
               self.trainer.eval_results(totals).items()}
    step = self.step
    self.eval_writer.scalars(step, {k: v for k, v in results.items()
                                    if k != "examples"})
    logging.info("eval  step %d: %s", step, ", ".join(
        f"{k}={v:.4f}" for k, v in sorted(results.items())))
    self.last_eval = results
    return results

  def _run_loop(self, iterator, num_steps):
    """Schedules `num_steps` closures, joins, returns their mean metrics."""
    limit = tf.constant(self.config.train_steps, tf.int64)
    remote = [self.coordinator.schedule(self._step_fn, args=(iterator, limit))
              for _ in range(num_steps)]
    self.coordinator.join()
    fetched = [r.fetch() for r in remote]
    trained = [m for m in fetched if m["trained"] > 0]
    if not trained:
      return {}
    return {k: float(sum(m[k] for m in trained) / len(trained))
            for k in trained[0] if k != "trained"}

  def run(self):
    """Trains to `train_steps` from the latest checkpoint; then evaluates."""
    try:
      return self._run()
    except cluster.PEER_ERRORS as e:
      # Worker failures are retried by the coordinator; what reaches here
      # is fatal (typically a lost ps task, whose variables are gone).
      raise cluster.peer_failure(e) from None

  def _run(self):
    c, trainer = self.config, self.trainer
    self.checkpoints.restore_latest()
    step = self.step
    if step >= c.train_steps:
      logging.info("Already at step %d of %d; nothing to train", step,
                   c.train_steps)
      return self.evaluate()
    self.train_writer.text(step, "flags", markdown_table(self.hparams))
    iterator = iter(self.coordinator.create_per_worker_dataset(
        self.dataset_fn))
    last_saved = step
    while step < c.train_steps:
      num_steps = min(c.steps_per_loop, c.train_steps - step)
      start = time.time()
      metrics = self._run_loop(iterator, num_steps)
      elapsed = time.time() - start
      previous, step = step, self.step
      if not metrics:
        continue
      if not math.isfinite(metrics["loss"]) and trainer.nan_policy == "stop":
        raise NonFiniteLossError(
            f"loss is {metrics['loss']} near step {step}; stopped without "
            f"saving (latest good checkpoint: "
            f"{self.checkpoints.latest or 'none'})")
      done = step - previous
      metrics["learning_rate"] = float(trainer.optimizer.learning_rate)
      metrics["steps_per_second"] = done / elapsed
      metrics["examples_per_second"] = (done * trainer.global_batch_size
                                        / elapsed)
      if _crossed(c.summary_every, previous, step) or step >= c.train_steps:
        self.train_writer.scalars(step, metrics)
      if _crossed(c.log_every, previous, step) or step >= c.train_steps:
        logging.info("train step %d/%d: loss=%.4f accuracy=%.4f "
                     "examples/s=%.1f", step, c.train_steps, metrics["loss"],
                     metrics.get("accuracy", float("nan")),
                     metrics["examples_per_second"])
      if _crossed(c.checkpoint_every, previous, step):
        self.checkpoints.save(step)
        last_saved = step
      if _crossed(c.eval_every, previous, step) and step < c.train_steps:
        self.evaluate()
      for fn in self.on_loop_end:
        fn(step)
    if last_saved != step:
      self.checkpoints.save(step)
    return self.evaluate()


def _crossed(every, previous, step):
  """Whether a multiple of `every` lies in (previous, step]."""
  return bool(every) and step // every > previous // every


def run(config, trainer_cls=None, strategy=None, on_loop_end=(),
        prepare_controller=None):
  """`experiment.run` for ParameterServerStrategy, on the coordinator.

  `prepare_controller(controller)`, if given, runs before training starts.
  """
  # pylint: disable=g-import-not-at-top
  import os
  from framework import datasets, strategies
  from framework.experiment import WEIGHTS_FILE, build_model_and_optimizer
  from framework.trainer import Trainer
  # pylint: enable=g-import-not-at-top
  strategy = strategy or strategies.make_strategy("parameter_server")
  dataset = datasets.load_dataset(config.dataset, config.data_dir,
                                  seed=config.seed)
  if not hasattr(dataset, "train_x"):
    raise ConfigError(
        f"dataset={config.dataset!r} is read from files, which "
        "parameter_server does not stream yet; use multi_worker_mirrored, "
        "or an in-memory dataset (cifar10, synthetic, shapes, oxford_pet)")
  model, optimizer, loop = build_model_and_optimizer(config, strategy,
                                                     dataset)
  trainer = (trainer_cls or Trainer)(
      model, optimizer, strategy, global_batch_size=config.global_batch_size,
      clip_norm=config.clip_norm, nan_policy=config.nan_policy)
  logging.info("strategy=parameter_server workers=%d dataset=%s train=%d",
               strategy.extended._num_workers, dataset.name,  # pylint: disable=protected-access
               len(dataset.train_x))

  def eval_dataset():
    return inputs.eval_dataset(dataset.test_x, dataset.test_y,
                               config.global_batch_size)

  controller = ParameterServerController(
      trainer, loop, config.model_dir,
      dataset_fn=per_worker_dataset_fn(dataset, config.global_batch_size,
                                       seed=config.seed),
      eval_dataset=eval_dataset, hparams=config.hparams,
      on_loop_end=on_loop_end)
  if prepare_controller is not None:
    prepare_controller(controller)
  results = controller.run()
  model.save_weights(os.path.join(config.model_dir, WEIGHTS_FILE))
  return results
