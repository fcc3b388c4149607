"""Builds a run from its plan: the model, the optimizer, the trainer and the
eval inputs; and the trainers of its self-check (`--check_distribution`).

The run (`build`) and its self-check (`check_experiment`) both
build through `build_trainer`, so the check checks the trainer that trains:
the same schedule length, label smoothing, gradient accumulation, float16
loss scale, EMA and NaN policy. The check itself (`framework.check`) knows
trainers and batches, and is imported only when a run asks for it.
"""

import dataclasses
import functools

from absl import logging
import keras
import tensorflow as tf

import models
from models import registry
from framework.app import config as app_config
from framework.app import run_plan
from framework import settings
from framework.app import resume
from framework.core import actions, adapt, checkpoints, optimizers, precision
from framework.core.checkpoints.manager import has_checkpoint
from framework.core import evaluation
from framework.core import protocols, ps_training
from framework.core.config import LoopConfig, TrainerConfig
from framework.core.controller import Controller, loop_parts
from framework.core.trainer import Trainer, smoothed_sparse_categorical_loss
from framework.data import datasets, inputs
from framework.data import preprocessing
from framework.distribute import strategies
from framework.model_parallel import parameter_sharding
from framework.model_parallel import recompute
from framework.model_parallel.config import layers_per_unit
from framework.errors import ConfigError, DistloopError
from framework.perf import flops, throughput
from framework.tasks import language_model, segmentation


def total_steps(config, num_train_examples):
  """The run's length in steps (`train_steps`, or `epochs` in steps)."""
  if config.train_steps is not None:
    return config.train_steps
  return config.epochs * inputs.steps_per_epoch(num_train_examples,
                                                config.global_batch_size)


def default_trainer_cls(dataset=None, *, task=None):
  """SegmentationTrainer for per-pixel labels, LanguageModelTrainer for
  token sequences, else the plain Trainer (`task`: the dataset's, as
  `language_model.task_name` or a `RunPlan` gives it)."""
  task = task or language_model.task_name(dataset)
  if task == language_model.TASK:
    return language_model.LanguageModelTrainer
  if task == "segmentation":
    return segmentation.SegmentationTrainer
  return Trainer


def optimizer_config(config, steps):
  """`config.optimizer` for a run of `steps` steps: a decaying schedule
  (cosine, linear, onecycle) without `total_steps` gets the run's length,
  and `lr_scaling` is applied to the learning rate."""
  result = config.optimizer
  if (result.schedule in optimizers.DECAYING_SCHEDULES
      and not result.total_steps):
    result = dataclasses.replace(result, total_steps=steps)
  if result.lr_scaling != "none":
    scaled = result.scaled(config.global_batch_size)
    logging.info("lr_scaling=%s: learning_rate %g for batch %d -> %g for "
                 "batch %d", result.lr_scaling, result.learning_rate,
                 result.base_batch_size, scaled.learning_rate,
                 config.global_batch_size)
    result = scaled
  # Its lengths checked now, before the model is built.
  optimizers.make_schedule(result)
  return result


def build_model_and_optimizer(config, strategy, dataset, build_model=None, *,
                              compute_precision=None, task=None,
                              scaled_pixels=None, scaled_pixels_why=None):
  """(model, optimizer, LoopConfig with the run's length) under `strategy`.

  `build_model(input_shape, num_classes, **options)` builds the model
  (default: the builder `config.model` names). `compute_precision` replaces
  `config.mixed_precision` for the model's dtype policy (None: the run's).
  `task`: the dataset's (None: from `dataset`). `scaled_pixels`,
  `scaled_pixels_why`: whether the inputs are uint8 images divided by 255
  and why (a `RunPlan`'s; None: from `dataset`), see `models.input_scale`.
  """
  if scaled_pixels is None and scaled_pixels_why is None:
    scaled_pixels, scaled_pixels_why = preprocessing.scaled_pixels(dataset)
  scale = dict(scaled_pixels=scaled_pixels, why=scaled_pixels_why)
  steps = total_steps(config, dataset.num_train_examples)
  loop = dataclasses.replace(config.loop or LoopConfig(train_steps=steps),
                             train_steps=steps)
  if loop.profile_steps and loop.profile_steps[0] > steps:
    raise ConfigError(
        f"profile_steps={loop.profile_steps} starts after the run's last "
        f"step (train_steps={steps}): nothing would be traced; choose steps "
        f"in 1..{steps}")
  optimizer_cfg = optimizer_config(config, steps)
  keras.utils.set_random_seed(config.seed)
  # Layers keep the dtype policy they are built with; restore the global one.
  policy = keras.mixed_precision.global_policy()
  precision.set_precision(compute_precision or config.mixed_precision)
  options = config.model_options
  if has_checkpoint(config.model_dir):
    # The checkpoint restored next holds every weight: the initial weights
    # file (keyword form) is not loaded, and may have moved.
    options = registry.architecture_options(config.model, options)
  try:
    with strategy.scope():
      try:
        if build_model is None:
          model = models.build_model(config.model, dataset.input_shape,
                                     dataset.num_classes, **scale,
                                     **options)
        else:
          model = registry.call_builder(build_model, dataset.input_shape,
                                        dataset.num_classes, options,
                                        name=config.model, **scale)
        _build_weights(model, dataset)
      except ConfigError:
        raise  # the builder's own check, already one line
      except ValueError as e:
        # Keras's long input-compatibility error: one line, before any work.
        raise ConfigError(
            f"model={config.model} cannot be built for the inputs of "
            f"dataset={config.dataset}, of shape "
            f"{tuple(dataset.input_shape)} ("
            f"{str(e).strip().splitlines()[0][:300]})") from None
      if task != registry.CUSTOM:  # a custom task's outputs are its own
        registry.check_outputs(config.model, model, dataset.num_classes,
                               config.dataset)
      if registry.declared_task(config.model) is None:
        # A model registered without its task is known once built (a
        # declared one `run_plan.resolve` checked before any build).
        models.check_task(config.model,
                          task or language_model.task_name(dataset),
                          config.dataset, model)
      optimizer = optimizers.make_optimizer(optimizer_cfg)
  finally:
    keras.mixed_precision.set_global_policy(policy)
  return model, optimizer, loop


def _build_weights(model, dataset):
  """Makes the weights of a model that makes them at its first call (a
  subclassed keras.Model): the optimizer's slots and a checkpoint's restore
  need them before the first step, and a step cannot make them."""
  if model.built:
    return
  # Tokens stay integers; every other feature reaches the model as float32.
  dtype = ("int32" if language_model.is_language_model(dataset)
           else "float32")
  model(keras.Input(tuple(dataset.input_shape), dtype=dtype), training=False)


def trainer_options(config, strategy):
  """The Trainer keyword arguments of a run of `config` under `strategy`:
  every step setting (`TrainerConfig`'s fields), whatever its value (a
  float16 run also gets a new `LossScale` for that strategy)."""
  step = TrainerConfig.of(config)
  if step.jit_compile and config.model_parallel.mode != "none":
    logging.warning("jit_compile: not supported with model_parallel=%s (a "
                    "stage's ops run on several devices, an XLA function on "
                    "one); training without XLA", config.model_parallel.mode)
    step = dataclasses.replace(step, jit_compile=False)
  options = dict(global_batch_size=config.global_batch_size,
                 **{f.name: getattr(step, f.name)
                    for f in dataclasses.fields(step)})
  if config.label_smoothing:
    options["loss_fn"] = smoothed_sparse_categorical_loss(
        config.label_smoothing)
  if precision.needs_loss_scale(config.mixed_precision):
    options["loss_scale"] = precision.LossScale(strategy)
  return options


def adapt_batches(config, dataset, train_input=None):
  """`() -> iterable` of the run's first training batches (unaugmented, as
  the model gets them), at most one epoch of them: what the model's
  preprocessing layers are adapted on (`framework.core.adapt`).

  `train_input`: a run's own (`experiment.run`); it must give a plain
  `tf.data.Dataset`, else a layer to adapt is a ConfigError.
  """

  def batches():
    if train_input is None:
      per_epoch = inputs.steps_per_epoch(dataset.num_train_examples,
                                         config.global_batch_size)
      return inputs.train_dataset(
          dataset, config.global_batch_size, seed=config.seed).take(per_epoch)
    data = train_input(0)
    if not isinstance(data, tf.data.Dataset):
      raise ConfigError(
          "train_input gives a distributed dataset: the model's "
          "preprocessing layers cannot be adapted on it; give a plain "
          "tf.data.Dataset, or adapt them in the builder")
    return data.map(preprocessing.scale_batch)

  return batches


def build_trainer(config, strategy, dataset, trainer_cls=None, *,
                  build_model=None, make_trainer=None, split=True,
                  compute_precision=None, plan=None, adapt_on=None):
  """(trainer, LoopConfig) of a run of `config` under `strategy`.

  Args:
    trainer_cls: default: the dataset's task decides (`default_trainer_cls`).
    build_model: as for `experiment.run` (default: `config.model`).
    make_trainer: `(model, optimizer, strategy, **trainer_options) ->
      trainer`, replacing `trainer_cls` and the model split.
    split: bind `trainer_cls` to `config.model_parallel`'s split (False:
      the unsplit trainer, the self-check's reference).
    compute_precision: the model's dtype policy instead of the run's (the
      float16 loss scale still follows `config.mixed_precision`).
    plan: the run's `RunPlan`, whose dataset task is read instead of
      deciding it again.
    adapt_on: `adapt_batches(...)`: the model's unadapted preprocessing
      layers are adapted on them (None: left as built; a resumed run
      restores them).
  """
  task = plan.task if plan is not None else None
  trainer_cls = trainer_cls or default_trainer_cls(dataset, task=task)
  scale = {} if plan is None else dict(
      scaled_pixels=plan.scaled_pixels,
      scaled_pixels_why=plan.scaled_pixels_why)
  # The layers (and a split's own) are made knowing what they recompute.
  with recompute.policy(config.model_parallel.recompute) as declared:
    model, optimizer, loop = build_model_and_optimizer(
        config, strategy, dataset, build_model,
        compute_precision=compute_precision, task=task, **scale)
    if not config.shard_parameters:  # its units are recomputed already
      recompute.apply(model, config.model_parallel.recompute, declared)
    if adapt_on is not None:
      # Before a split or a trainer sees the model: one unsplit state.
      with strategy.scope():
        adapt.adapt(model, adapt_on, max_examples=config.adapt_examples,
                    name=config.model)
    if make_trainer is None:
      # The model-parallel trainers load only when a split is asked for.
      split = split and config.model_parallel.mode != "none"
      make_trainer = (config.model_parallel.trainer_factory(trainer_cls)
                      if split else trainer_cls)
      if config.shard_parameters and split:
        # ZeRO-3 over the split's copies: the pipeline trainer's own.
        make_trainer = functools.partial(make_trainer, shard_parameters=True)
      elif config.shard_parameters and strategy.num_replicas_in_sync == 1:
        logging.info("shard_parameters: one replica, nothing to shard")
      elif config.shard_parameters:
        make_trainer = parameter_sharding.sharded_trainer(
            make_trainer,
            layers_per_unit(config.model_parallel.recompute))
    trainer = make_trainer(model, optimizer, strategy,
                           **trainer_options(config, strategy))
  return trainer, loop


def build(plan, trainer_cls=None, *, build_model=None, train_input=None,
          eval_input=None, make_trainer=None, train_actions=(),
          start_time=None, handle_preemption=False):
  """(trainer, controller) of the run `plan` describes.

  Without `trainer_cls`, the dataset's task decides: per-pixel labels get a
  `SegmentationTrainer` (pixel accuracy, mean IoU) and mask summaries. The
  keyword arguments replace the defaults; see `experiment.run`.
  `train_actions`, `start_time` and `handle_preemption` go to the
  Controller (finished here: nothing is added to it after).
  """
  config, strategy, dataset = plan.config, plan.strategy, plan.dataset
  # A new run adapts its preprocessing layers; a resumed one restores them.
  adapt_on = (None if has_checkpoint(config.model_dir)
              else adapt_batches(config, dataset, train_input))
  trainer, loop = build_trainer(
      config, strategy, dataset, trainer_cls, build_model=build_model,
      make_trainer=make_trainer, plan=plan, adapt_on=adapt_on)
  # Before a parameter-server coordinator wraps the trainer; of a split
  # model the unsplit one, whose architecture any mesh (or none) shares.
  model = protocols.unsplit_model(trainer)
  # The loss scale's and the EMA's state, where the trainer declares them.
  checkpoint_items = checkpoints.checkpoint_items(trainer)
  # What a checkpoint must agree on with a run resuming from it.
  run_config = resume.run_config(config, model)
  if getattr(dataset, "generation", None):
    # Resuming on re-converted data (another content) is a config change.
    run_config["data_generation"] = dataset.generation
  if getattr(dataset, "mix_shares", None):
    # --dataset=mix: resuming on other sources or weights is a config change.
    run_config["mix"] = dataset.mix_shares
  augment_fn = preprocessing.get_augmentation(config.augment)

  def default_train_input(start_step):
    return inputs.distribute_train(
        strategy, dataset, config.global_batch_size, seed=config.seed,
        start_step=start_step, augment=augment_fn,
        input_mode=config.input_mode)

  epoch_known = train_input is None  # best.json's epoch
  train_input = train_input or default_train_input
  eval_inputs = None
  if plan.parameter_server:
    # The coordinator schedules the steps on the workers; the Controller
    # around it is the same (framework/core/ps_training.py).
    trainer, train_input, eval_input = ps_training.coordinate(
        trainer, dataset, config.global_batch_size, seed=config.seed,
        augment=augment_fn)
    check_parameter_server(config)
  else:
    # The run's own set (eval/) and --eval_sets (eval_<name>/).
    eval_inputs = build_eval_inputs(config, strategy, dataset, eval_input)
    eval_input = None
  # What the loop is handed: its parts and the manager it saves through.
  parts = loop_parts(trainer, checkpoint_items=checkpoint_items)
  parts.throughput = run_throughput(plan, model, counted=build_model is None)
  manager = checkpoints.for_loop(
      parts, config.model_dir, max_to_keep=loop.keep_checkpoints,
      sharding=loop.checkpoint_sharding,
      restore_policy=config.restore, run_config=run_config,
      allow_config_change=config.allow_config_change,
      async_checkpoint=loop.async_checkpoint)
  kwargs = dict(train_input=train_input, eval_input=eval_input,
                eval_inputs=eval_inputs,
                hparams=config.hparams or settings.hparams(config),
                parts=parts, checkpoints=manager,
                # One line if the loss stays at chance (double scaling, lr,
                # frozen weights).
                train_actions=[actions.LossAtChance(
                    dataset.num_classes, config.global_batch_size),
                               *train_actions],
                start_time=start_time, handle_preemption=handle_preemption,
                # best.json's epoch, when the run makes its own batches.
                steps_per_epoch=inputs.steps_per_epoch(
                    dataset.num_train_examples, config.global_batch_size)
                if epoch_known else None)
  if plan.is_segmentation:
    controller = segmentation.SegmentationController(
        trainer, loop, config.model_dir,
        samples=dataset.test_samples(3), **kwargs)
  else:
    controller = Controller(trainer, loop, config.model_dir, **kwargs)
  return trainer, controller


def run_throughput(plan, model, *, counted=True):
  """The `Throughput` of the run `plan` describes (FLOP/s, MFU, tokens/s in
  its log line and `train/`), or None where the model's FLOPs cannot be
  counted. `model` is the unsplit model; `counted`: `plan.config.model`
  built it, so its registered closed form applies (else its graph)."""
  config, dataset = plan.config, plan.dataset
  counter = registry.flops_counter(config.model) if counted else None
  try:
    if counter is not None:
      per_example = counter(model)
    else:
      inputs_dtype = (model.inputs[0].dtype if getattr(model, "inputs", None)
                      else "float32")
      per_example = flops.model_flops_per_example(
          model, dataset.input_shape, inputs_dtype)
  except Exception as e:  # pylint: disable=broad-except
    # A diagnostic: a model whose graph cannot be traced alone still trains.
    logging.info("no FLOP/s or MFU in the log: the FLOPs of model=%s "
                 "could not be counted (%s)", config.model,
                 str(e).strip().splitlines()[0][:200] if str(e) else
                 type(e).__name__)
    return None
  if not per_example:
    return None
  # The devices it computes on: the strategy's, and a split's (its copies'
  # groups, or the one copy's local devices under the default strategy).
  split = plan.model_parallel
  devices = set(plan.devices).union(*map(set, split.replica_devices))
  if (split.mode != "none" and not split.replica_devices
      and split.devices == "local"):
    from framework.model_parallel import devices as split_devices  # pylint: disable=g-import-not-at-top
    devices.update(split_devices.model_parallel_devices(
        split.device_count[0]))
  resolver = getattr(plan.strategy, "cluster_resolver", None)
  cluster = resolver.cluster_spec().as_dict() if resolver is not None else {}
  # Processes that compute (a parameter-server chief only coordinates).
  processes = len(cluster.get("worker", ())) + (
      0 if "ps" in cluster else len(cluster.get("chief", ())))
  return throughput.for_run(
      per_example, precision=plan.precision, devices=devices,
      processes=processes or 1,
      tokens_per_example=(int(dataset.input_shape[0])
                          if plan.is_language_model else None))


def check_experiment(config, strategy, dataset, trainer_cls=None, *,
                     build_model=None, make_trainer=None, print_fn=print,
                     plan=None):
  """The check for an `ExperimentConfig` run (what `--check_distribution` does).

  Builds a trainer under `strategy` and a reference on one device, exactly
  as the run builds its own, and checks them on the run's first global
  batch. The real run is untouched: its build re-seeds. A run computing in
  bfloat16 or float16 is checked in float32 (with its float16 loss scale):
  one step's low-precision rounding moves the weights by more than the
  check's tolerance between N replicas and one device.

  Args:
    trainer_cls, build_model, make_trainer: as for `experiment.run`.
    plan: the run's `RunPlan` (default: that of `config`, `strategy` and
      `dataset`), whose precision and task the check reads.

  Raises:
    DistributionCheckError: the verdict is fail (the causes in the message).
  """
  # Only a run that asks for the check loads it.
  # pylint: disable=g-import-not-at-top
  from framework.check import distribution_check
  from framework.check.distribution_diagnosis import Finding
  # pylint: enable=g-import-not-at-top
  batch = next(iter(inputs.train_dataset(dataset, config.global_batch_size,
                                         seed=config.seed)))
  one_device = strategies.make_strategy("one_device")
  plan = plan or run_plan.RunPlan.of(config, strategy, dataset)
  config = plan.config
  compute = plan.precision
  notes = []
  if compute != "float32":
    notes.append(Finding(
        "compared_in_float32",
        f"the run computes in {compute}; the check built both sides in "
        "float32 (its rounding alone moves one step by more than the "
        "tolerance), so the low-precision compute itself is not covered"))

  if config.shard_optimizer_state and config.model_parallel.mode != "none":
    # The probe optimizer replaces copy 0's only: the other copies would
    # update their slices of the weights with the run's own optimizer.
    config = dataclasses.replace(config, shard_optimizer_state=False,
                                 shard_gradients=False)
    notes.append(Finding(
        "checked_unsharded",
        "the run shards its optimizer state over the mesh's data axis; the "
        "check built both sides unsharded (its probe optimizer replaces "
        "the run's), so the sharded update itself is not covered (it "
        "equals the unsharded one: tests/test_optimizer_sharding_mesh.py)"))

  def factory_for(s, split_model=True, reference_cls=None):
    def make():
      trainer, _ = build_trainer(
          config, s, dataset, trainer_cls, build_model=build_model,
          make_trainer=make_trainer or reference_cls,
          split=split_model,
          compute_precision="float32" if notes else None, plan=plan,
          # Both sides start as the run does (the check's models are new).
          adapt_on=adapt_batches(config, dataset))
      return trainer
    return make

  split = config.model_parallel
  # Distributed: the run's trainer under `strategy` (or its model split);
  # the reference: the unsplit step on one device ...
  reference = factory_for(one_device, split_model=False)
  if split.mode == "tensor":
    # ... but a tensor split against its own shards all on one device (the
    # same variables).
    devices = [one_device.extended.worker_devices[0]] * split.num_shards
    split_cls = split.trainer_factory(
        trainer_cls or default_trainer_cls(task=plan.task))
    reference = factory_for(tf.distribute.get_strategy(),
                            reference_cls=functools.partial(split_cls,
                                                            devices=devices))
  keras.utils.set_random_seed(config.seed)
  report = distribution_check.check_distribution(
      factory_for(strategy), reference, batch, notes=notes,
      print_fn=print_fn)
  if report.verdict == distribution_check.FAIL:
    raise distribution_check.DistributionCheckError(
        "distribution check failed: " +
        "; ".join(f"{c.code}: {c.message}" for c in report.causes))
  return report


def build_eval_inputs(config, strategy, dataset, eval_input=None):
  """{name: `() -> dataset`} for the Controller: the run's own set (`eval`,
  `eval_input` or `dataset`'s test split) and `config.eval_sets`, each
  limited to `config.loop.eval_steps` global batches if that is set."""
  steps = config.loop.eval_steps if config.loop else None
  batch = config.global_batch_size
  found = {"eval": eval_input or (lambda: _distributed(
      strategy, dataset, batch, "test", steps))}
  for spec in app_config.parse_all(config.eval_sets):
    try:
      other = datasets.load_dataset(spec.dataset, spec.data_dir,
                                    seed=config.seed,
                                    **config.dataset_options)
    except DistloopError as e:
      # Which flag named the data: the main dataset loaded fine.
      raise type(e)(f"eval_sets={spec.name}:{spec.dataset}: {e}") from None
    _check_fits(spec, other, dataset)
    found[spec.name] = (lambda other=other, spec=spec: _distributed(
        strategy, other, batch, spec.split, steps))
  return found


def check_parameter_server(config):
  """ConfigError if `config` asks for what a parameter-server run's own
  evaluation (on the coordinator, `ps_training`) does not do."""
  for name, value in (("eval_sets", config.eval_sets),
                      ("eval_steps", config.loop and config.loop.eval_steps)):
    if value:
      raise ConfigError(f"{name}={value!r} is not supported under "
                        "strategy=parameter_server (its coordinator "
                        "evaluates the run's own test split)")


def _check_fits(spec, other, dataset):
  if list(other.input_shape) != list(dataset.input_shape):
    raise ConfigError(
        f"eval_sets={spec.name}:{spec.dataset}: inputs of shape "
        f"{tuple(other.input_shape)}; the run trains on "
        f"{tuple(dataset.input_shape)}")
  ours, theirs = (getattr(d, "num_classes", None) for d in (dataset, other))
  if ours is not None and theirs is not None and ours != theirs:
    raise ConfigError(f"eval_sets={spec.name}:{spec.dataset}: {theirs} "
                      f"classes; the run trains on {ours}")
  if spec.split == "train" and not hasattr(other, "train_x"):
    raise ConfigError(f"eval_sets={spec.name}:{spec.dataset}:...:train: "
                      "split=train needs an in-memory dataset (this one "
                      "streams its test split only)")


def _distributed(strategy, dataset, batch, split, steps):
  """One pass over `dataset`'s `split`, padded, at most `steps` batches."""
  if split == "train" or steps is not None:
    if hasattr(dataset, "eval_dataset_fn"):  # streamed from files
      fn = dataset.eval_dataset_fn(batch)
      # A pipeline's elements are per-replica batches, one per replica it
      # feeds at each step: `steps` global batches are that many times more.
      return evaluation.Distributed(strategy.distribute_datasets_from_function(
          lambda context: fn(context).take(
              steps * (context.num_replicas_in_sync //
                       context.num_input_pipelines))), steps)
    if hasattr(dataset, "eval_dataset"):
      return dataset.eval_dataset(batch)
    x, y = ((dataset.train_x, dataset.train_y) if split == "train"
            else (dataset.test_x, dataset.test_y))
    return inputs.eval_dataset(x, y, batch)  # the Controller cuts it
  return inputs.distribute_test(strategy, dataset, batch)
