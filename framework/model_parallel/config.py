"""How a run splits its model: the config that `scripts/train.py` fills."""

import dataclasses
import functools

from framework.errors import ConfigError
from framework.model_parallel.choices import BALANCES, MODES, PLACEMENTS  # pylint: disable=unused-import
from framework.model_parallel.mesh import check_device_count, parse_mesh
from framework.model_parallel.split_config import SPLIT_READ_BY, SplitConfig
from framework.settings import check_settings, same_as, setting

# This module imports no TensorFlow at load time (the flags are made from
# ModelParallelConfig before TensorFlow loads): the trainers and devices are
# imported where they are used.


@dataclasses.dataclass(frozen=True)
class ModelParallelConfig:
  """Model parallelism for one run.

  Attributes:
    mode: `none`, `pipeline` (layers cut into stages) or `tensor` (one
      hidden Dense layer's units split across devices).
    num_stages: pipeline stages (= devices).
    num_microbatches: micro-batches per global batch (GPipe schedule).
    stage_boundaries: pipeline cut points between layers: indices, or layer
      names (a name starts a stage); empty: balanced by `stage_balance`.
    num_shards: tensor: devices the hidden units are split across.
    split_layer: tensor: index of the Dense layer to split (None: the last
      Dense followed by a Dense).
    devices: `local` (this process's GPUs or logical CPUs) or `cluster`
      (piece i on `/job:worker/task:i`; the chief must have called
      `devices.connect_cluster` first).
    recompute: keep only each stage's inputs per micro-batch and recompute
      its forward pass in the backward pass (GPipe's re-materialisation).
    serial_stages: each stage device runs its ops one at a time, in program
      order, as a GPU stream does (`streams.DeviceStreams`).
    input_grads_first: with serial_stages, each stage computes the input
      gradient it sends back before its weight gradients (B before W).
    stage_balance: pipeline cut points without `stage_boundaries`:
      `flops` (per-layer forward + backward FLOPs) or `params`.
    mesh: `data:R,model:S` (data x tensor), `data:R,pipeline:S` or one
      split axis (`mesh.parse_mesh`): sets `mode`, `num_shards` or
      `num_stages` and `data_axis`; empty: the flags above.
    data_axis: copies of the split (from `mesh`; set, not given).
    tensor_stages: tensor x pipeline: the stages of a tensor split, each on
      its own `num_shards` devices (from `mesh`'s pipeline axis with a
      model axis; set, not given).
    replica_devices: data x pipeline (x tensor): R tuples of `num_stages`
      (`num_shards`) devices, one copy of the split on each (set by
      `with_strategy`; empty: one copy).
  """
  mode: str = setting(
      "none", "pipeline: cut the layers into --num_stages stages on as many "
      "devices; tensor: split one hidden Dense layer's units across "
      "--num_shards devices.", flag="model_parallel", choices=MODES)
  num_stages: int = same_as(SplitConfig, "num_stages")
  num_microbatches: int = same_as(SplitConfig, "num_microbatches")
  stage_boundaries: tuple[int | str, ...] = same_as(SplitConfig,
                                                    "stage_boundaries")
  num_shards: int = same_as(SplitConfig, "num_shards")
  split_layer: int | None = same_as(SplitConfig, "split_layer")
  devices: str = setting(
      "local", "local: this process's GPUs or --cpu_devices; cluster: "
      "stage/shard i on TF_CONFIG's worker i, the chief runs the loop "
      "(scripts/launch.py --workers=N adds the chief).",
      flag="model_parallel_devices", choices=PLACEMENTS, read_by=SPLIT_READ_BY)
  recompute: bool = same_as(SplitConfig, "recompute")
  serial_stages: bool = same_as(SplitConfig, "serial_stages")
  input_grads_first: bool = same_as(SplitConfig, "input_grads_first")
  stage_balance: str = same_as(SplitConfig, "stage_balance")
  mesh: str = setting(
      "", "One device mesh for the split, e.g. data:2,model:2 (data x "
      "tensor), data:2,pipeline:2 or model:4; axes data, model, pipeline; "
      "their product must be the device count. --model_parallel with "
      "--num_shards/--num_stages is the one-axis mesh.")
  replica_devices: tuple = setting((), flag=False)  # set by with_strategy
  data_axis: int = setting(1, flag=False)  # set from `mesh`
  tensor_stages: int = same_as(SplitConfig, "tensor_stages")  # from `mesh`

  def __post_init__(self):
    check_settings(self)
    if self.mesh:
      self._apply_mesh()
    if self.serial_stages and self.mode == "none":
      raise ConfigError("serial_stages orders the ops of each stage of a "
                        "split model; set --model_parallel=pipeline or "
                        "tensor")
    if self.recompute and self.mode == "none":
      raise ConfigError("recompute re-runs the stages of a split model in "
                        "the backward pass; set --model_parallel=pipeline "
                        "or tensor")
    if self.devices == "cluster" and self.mode == "none":
      raise ConfigError("model_parallel_devices=cluster places the pieces of "
                        "a split model; set --model_parallel=pipeline or "
                        "tensor")

  def _apply_mesh(self):
    """Sets mode, num_shards/num_stages and data_axis from `mesh`."""
    sizes = parse_mesh(self.mesh)
    mode = "tensor" if sizes.get("model", 1) > 1 else "pipeline"
    if self.mode not in ("none", mode):
      raise ConfigError(f"mesh={self.mesh} is a {mode} split; it disagrees "
                        f"with --model_parallel={self.mode} (drop one)")
    object.__setattr__(self, "mode", mode)
    object.__setattr__(self, "data_axis", sizes.get("data", 1))
    if mode == "tensor":
      object.__setattr__(self, "num_shards", sizes["model"])
      object.__setattr__(self, "tensor_stages", sizes.get("pipeline", 1))
    else:
      object.__setattr__(self, "num_stages", sizes["pipeline"])

  def check_model(self, model, num_heads, vocab_size, num_layers=0):
    """Raises ConfigError when a tensor split cannot cut `model` (the
    shards must divide a gpt's heads and vocabulary, a tensor x pipeline
    mesh needs a model with a whole split and a block per stage, and so
    does a gpt pipeline, which runs that split); before any build."""
    if self.mode == "pipeline" and model == "gpt":
      if num_layers and num_layers < self.num_stages:
        where = (f"mesh={self.mesh}: the pipeline axis" if self.mesh
                 else "num_stages")
        raise ConfigError(
            f"{where}={self.num_stages} needs at least one gpt block per "
            f"stage; num_layers={num_layers}")
      return
    if self.mode != "tensor":
      return
    if self.tensor_stages > 1 and model != "gpt":
      raise ConfigError(
          f"mesh={self.mesh}: tensor x pipeline (model and pipeline axes "
          f"both > 1) splits a transformer; model={model} has no whole-model "
          "split (use model=gpt, or one of the axes)")
    if model != "gpt":
      return
    if num_layers and num_layers < self.tensor_stages:
      raise ConfigError(
          f"mesh={self.mesh}: the pipeline axis={self.tensor_stages} needs at "
          f"least one gpt block per stage; num_layers={num_layers}")
    where = f"mesh={self.mesh}: the model axis" if self.mesh else "num_shards"
    for name, size in (("num_heads", num_heads), ("vocab_size", vocab_size)):
      if size and size % self.num_shards:
        raise ConfigError(
            f"{where}={self.num_shards} does not divide gpt {name}={size}; "
            f"use a divisor of {size}")

  @property
  def device_count(self):
    """(devices the split needs, the argument that sets it)."""
    if self.mode == "tensor":
      return self.num_shards * self.tensor_stages, "num_shards"
    return self.num_stages, "num_stages"

  def with_strategy(self, strategy, name):
    """(config, strategy) for a run under `strategy` (flag value `name`).

    A pipeline (a tensor split) under a multi-replica local strategy
    (mirrored) becomes data x pipeline (data x tensor): the strategy's
    R * S devices (S = num_stages or num_shards) are cut into R groups of
    S consecutive devices (`replica_devices`) and the run uses one replica
    (the default strategy). Anything else is returned
    as it is (the trainers reject other splits with several replicas).

    Raises:
      ConfigError: the device count is not a multiple of num_stages, or
        a strategy other than mirrored, or cluster placement.
    """
    if self.mesh and self.devices == "local":
      return self._mesh_strategy(strategy, name)
    if self.mesh:
      return self._cluster_mesh_strategy(strategy, name)
    if self.mode == "none" or strategy.num_replicas_in_sync == 1:
      return self, strategy
    if self.devices == "cluster":
      raise ConfigError(
          f"model_parallel_devices=cluster with strategy={name} is not "
          "supported; use strategy=default (one pipeline over the workers)")
    from framework.model_parallel.replicas import split_strategy  # pylint: disable=g-import-not-at-top
    count, argument = self.device_count
    strategy, groups = split_strategy(strategy, count, name=name,
                                      argument=argument)
    return dataclasses.replace(
        self, replica_devices=tuple(tuple(g) for g in groups)), strategy

  def _mesh_strategy(self, strategy, name):
    """(config, one-replica strategy) of a `mesh` run: its data axis cut
    from this process's devices (no data-parallel strategy needed)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from framework.model_parallel.replicas import replica_groups  # pylint: disable=g-import-not-at-top
    from framework.model_parallel.devices import model_parallel_devices  # pylint: disable=g-import-not-at-top
    if strategy.num_replicas_in_sync != 1:
      raise ConfigError(
          f"mesh={self.mesh} makes its own data axis; use strategy=default "
          f"(not {name})")
    sizes = parse_mesh(self.mesh)
    check_device_count(self.mesh, sizes,
                       len(tf.config.list_logical_devices("GPU")),
                       len(tf.config.list_logical_devices("CPU")))
    if self.data_axis == 1:
      return self, strategy
    count, argument = self.device_count
    groups = replica_groups(model_parallel_devices(count * self.data_axis),
                            count, strategy=name, name=argument)
    return dataclasses.replace(
        self, replica_devices=tuple(tuple(g) for g in groups)), strategy

  def _cluster_mesh_strategy(self, strategy, name):
    """(config, one-replica strategy) of a mesh on a cluster: copy r of the
    split on worker task r's devices (`mesh_cluster`); call after
    `devices.start_cluster` connected this chief."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from framework.model_parallel import mesh_cluster  # pylint: disable=g-import-not-at-top
    if strategy.num_replicas_in_sync != 1:
      raise ConfigError(
          f"mesh={self.mesh} makes its own data axis; use strategy=default "
          f"(not {name})")
    groups = mesh_cluster.cluster_groups(
        self.mesh, parse_mesh(self.mesh),
        [d.name for d in tf.config.list_logical_devices()])
    return dataclasses.replace(
        self, replica_devices=tuple(tuple(g) for g in groups)), strategy

  def trainer_factory(self, trainer_cls=None):
    """`trainer_cls`, or the model-parallel trainer bound to this config.

    A plain `Trainer` subclass (e.g. the segmentation trainer, for its
    evaluation metrics) is combined with the model-parallel trainer: the
    split trains, the subclass evaluates the (whole) model.
    """
    # pylint: disable=g-import-not-at-top
    from framework.core.trainer import Trainer
    from framework.model_parallel.devices import cluster_devices
    from framework.model_parallel.pipeline import PipelineTrainer
    from framework.model_parallel.routing import pipeline_trainer
    from framework.model_parallel.staged_trainer import StagedTrainer
    from framework.model_parallel.tensor_parallel import TensorParallelTrainer
    # pylint: enable=g-import-not-at-top
    trainer_cls = trainer_cls or Trainer
    if self.mode == "none":
      return trainer_cls

    def combined(parallel_cls):
      if trainer_cls is Trainer or issubclass(trainer_cls, parallel_cls):
        return parallel_cls if trainer_cls is Trainer else trainer_cls
      if not issubclass(trainer_cls, Trainer) or issubclass(
          trainer_cls, StagedTrainer):
        raise ConfigError(
            f"model_parallel={self.mode} needs a trainer derived from "
            f"{parallel_cls.__name__}; got {trainer_cls.__name__}")
      # The split's eval_logits, the subclass's eval_sums and eval_results.
      # TensorParallel + LanguageModelTrainer -> TensorParallelLanguageModel
      # Trainer (the name logs and model_info.json show).
      name = (parallel_cls.__name__.removesuffix("Trainer") +
              trainer_cls.__name__)
      return type(name, (parallel_cls, trainer_cls), {})

    devices = None
    if self.devices == "cluster" and not self.replica_devices:
      devices = cluster_devices(self.device_count[0])
    if self.mode == "pipeline":
      # A model with its own whole-model split (gpt) runs it as the
      # pipeline; any other has its layers cut (`routing`).
      pipeline_cls = combined(PipelineTrainer)
      split_cls = (combined(TensorParallelTrainer)
                   if not issubclass(trainer_cls, PipelineTrainer)
                   else None)
      return functools.partial(
          pipeline_trainer, pipeline_cls=pipeline_cls, split_cls=split_cls,
          num_stages=self.num_stages,
          num_microbatches=self.num_microbatches,
          stage_boundaries=tuple(self.stage_boundaries) or None,
          stage_balance=self.stage_balance, recompute=self.recompute,
          serial_stages=self.serial_stages,
          input_grads_first=self.input_grads_first, devices=devices,
          **({"replica_devices": [list(g) for g in self.replica_devices]}
             if self.replica_devices else {}))
    return functools.partial(
        combined(TensorParallelTrainer), num_shards=self.num_shards,
        split_layer=self.split_layer,
        num_microbatches=self.num_microbatches, recompute=self.recompute,
        serial_stages=self.serial_stages,
        input_grads_first=self.input_grads_first, devices=devices,
        **({"tensor_stages": self.tensor_stages} if self.tensor_stages > 1
           else {}),
        **({"replica_devices": [list(g) for g in self.replica_devices]}
           if self.replica_devices else {}))
