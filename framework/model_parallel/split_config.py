"""The settings the split trainers take as keyword arguments, declared once.

`StagedTrainer`, `PipelineTrainer`, `TensorParallelTrainer` and the
pipeline's cut functions default their keywords to these fields, and
`ModelParallelConfig` declares the same fields (`settings.same_as`), so
each setting has one default, help and check. A module of its own (no
TensorFlow): `config.py` imports the trainers where it binds them, so the
trainers cannot import `config.py` without an import cycle.
"""

import dataclasses

from framework.model_parallel.choices import BALANCES
from framework.settings import POSITIVE, check_settings, setting

# What only a split model reads (`setting(read_by=...)`).
SPLIT_READ_BY = {"model_parallel": ("pipeline", "tensor")}
PIPELINE_READ_BY = {"model_parallel": ("pipeline",)}
TENSOR_READ_BY = {"model_parallel": ("tensor",)}


@dataclasses.dataclass(frozen=True)
class SplitConfig:
  """How a split trainer cuts and schedules the model (each field as in
  `ModelParallelConfig`)."""
  num_stages: int = setting(2, "Pipeline stages (devices).",
                            minimum=POSITIVE, read_by=PIPELINE_READ_BY)
  num_microbatches: int = setting(
      1, "Micro-batches per global batch (GPipe schedule); must divide "
      "--global_batch_size.", minimum=POSITIVE, read_by=SPLIT_READ_BY)
  stage_boundaries: tuple[int | str, ...] = setting(
      (), "Pipeline cut points between layers, e.g. '3', '2,5' or layer "
      "names (a name starts a stage); default: balanced by "
      "--stage_balance.", read_by=PIPELINE_READ_BY)
  num_shards: int = setting(2, "Tensor parallel: devices the hidden units "
                            "are split across.", minimum=POSITIVE,
                            read_by=TENSOR_READ_BY)
  split_layer: int | None = setting(
      None, "Tensor parallel: index of the Dense layer to split (default: "
      "the last Dense followed by a Dense).", read_by=TENSOR_READ_BY)
  recompute: bool = setting(
      False, "Model parallel: keep only each stage's inputs per micro-batch "
      "and recompute its forward pass in the backward pass (less "
      "activation memory, one more forward pass per step).", read_by=SPLIT_READ_BY)
  serial_stages: bool = setting(
      False, "Model parallel: each stage device runs its ops one at a time, "
      "in program order, as a GPU stream does (logical CPU devices "
      "otherwise run several of a stage's ops at once on the shared "
      "cores).")
  input_grads_first: bool = setting(
      True, "Model parallel, with --serial_stages: each stage computes the "
      "input gradient it sends back before its weight gradients (B before "
      "W, as zero-bubble pipelines do: a smaller bubble); false: the "
      "backward pass in creation order.", read_by=SPLIT_READ_BY)
  tensor_stages: int = setting(
      1, "Tensor x pipeline: the stages of a tensor split, each split "
      "across its own devices (set from --mesh's pipeline axis).",
      flag=False, minimum=POSITIVE)
  stage_balance: str = setting(
      "flops", "Pipeline cut points without --stage_boundaries: equal "
      "forward+backward conv/matmul FLOPs per stage, or equal parameter "
      "counts.", choices=BALANCES, read_by=PIPELINE_READ_BY)

  def __post_init__(self):
    check_settings(self)
