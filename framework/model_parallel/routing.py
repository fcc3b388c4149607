"""Which trainer runs a pipeline split: the layer cut or a whole-model split.

`--model_parallel=pipeline --num_stages=S` (the mesh `pipeline:S`, with
`data:R` too) cuts a model's layers into S stages (`PipelineTrainer`).
A model with a registered whole-model split (`parallel_layers.split_for`,
e.g. `gpt`, whose token table is read twice: the lookup and the tied head,
which a layer cut cannot place) is cut by its own split instead: one shard
per stage, `TensorParallelTrainer(num_shards=1, tensor_stages=S)`, the
same S-stage pipeline of its blocks. Every other model (CNN, MLP, U-Net)
keeps the layer cut.
"""

from absl import logging

from framework.errors import ConfigError
from framework.model_parallel.parallel_layers import split_for


def pipeline_trainer(model, optimizer, strategy, *, pipeline_cls, split_cls,
                     num_stages, stage_boundaries=None, stage_balance=None,
                     **kwargs):
  """The trainer of an S-stage pipeline of `model`.

  Args:
    model, optimizer, strategy: as for `Trainer`.
    pipeline_cls: the layer-cutting trainer (a `PipelineTrainer`).
    split_cls: the whole-model split's trainer (a `TensorParallelTrainer`),
      for a model `split_for` knows (None: the layer cut for every model).
    num_stages: S.
    stage_boundaries, stage_balance: the layer cut's (a whole-model split
      cuts its blocks evenly itself).
    **kwargs: both trainers' (micro-batches, devices, replica_devices,
      recompute, ..., the `Trainer` arguments).

  Raises:
    ConfigError: stage boundaries given for a model cut by its own split.
  """
  if split_cls is None or split_for(model) is None:
    return pipeline_cls(model, optimizer, strategy, num_stages=num_stages,
                        stage_boundaries=stage_boundaries,
                        stage_balance=stage_balance, **kwargs)
  if stage_boundaries:
    raise ConfigError(
        f"stage_boundaries={list(stage_boundaries)} cut a list of layers; "
        f"model={model.name} is cut into its num_stages={num_stages} stages "
        "by its own split (its blocks, evenly); drop --stage_boundaries")
  logging.info(
      "model=%s has a whole-model split: its %d-stage pipeline runs as "
      "%s(num_shards=1, tensor_stages=%d), its blocks cut into stages (not "
      "%s's layer cut)", model.name, num_stages, split_cls.__name__,
      num_stages, pipeline_cls.__name__)
  return split_cls(model, optimizer, strategy, num_shards=1,
                   tensor_stages=num_stages, **kwargs)
