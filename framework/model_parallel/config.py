"""How a run splits its model: its settings and its device mesh.

`ModelParallelConfig` is what `scripts/train.py` fills (`--model_parallel`,
`--mesh`, ...); `SplitConfig` holds the settings the split trainers also
take as keyword arguments, declared once (`settings.same_as`), so each has
one default, help and check. This module imports no TensorFlow at load
time: the flags are made from it before TensorFlow loads, and the devices
and trainers are imported where they are used. Which models carry their
own whole-model split (`register_split`, `split_for`) is known here too,
without loading the split.

`--mesh=data:2,model:2`: one device mesh for every split. Axes: `data`
(copies of the model, each on its own devices, gradients all-reduced across
them), `model` (tensor parallelism: the devices one copy's layers are cut
across) and `pipeline` (stages). The product of the sizes is the number of
devices the run uses. `--model_parallel=tensor --num_shards=S` is the
one-axis mesh `model:S`, `--model_parallel=pipeline --num_stages=S` is
`pipeline:S`, and `--strategy=mirrored` with R * S devices adds `data:R`.

A mesh over the tasks of a cluster puts its data axis across processes:

    scripts/launch.py --workers=2 -- python scripts/train.py --model=gpt \\
        --mesh=data:2,model:2 --model_parallel_devices=cluster --cpu_devices=2

      worker 0  /job:worker/task:0/CPU:0  /CPU:1    copy 0 (checkpointed)
      worker 1  /job:worker/task:1/CPU:0  /CPU:1    copy 1
      chief     the training loop, the input, the checkpoints (launch.py
                adds it; it holds no variable)

Copy r of the split lives on worker task r, one process: the tensor
split's all-reduces (the model axis, two per block and step) never leave
it, and only the gradient all-reduce (the data axis: shard d of copy 0
with shard d of copy 1) crosses processes, once per step. The other way
round (a copy's shards on different tasks) would send every block's
activations over the network twice per pass. Each worker task offers the
devices of one copy: `--cpu_devices` of them (its gRPC server's CPU
devices), or its GPUs. The chief drives every task from one program
(TensorFlow's distributed runtime); the all-reduces are TensorFlow's
collectives over the remote devices.
"""

import dataclasses

from framework.errors import ConfigError
from framework.settings import POSITIVE, check_settings, same_as, setting

MODES = ("none", "pipeline", "tensor")
# Pipeline cut points without explicit boundaries (see `pipeline`).
BALANCES = ("flops", "params")
# Where the pieces of a split model run (see `devices`).
PLACEMENTS = ("local", "cluster")
# The axes of a `--mesh`.
AXES = ("data", "model", "pipeline")


def parse_mesh(text):
  """`"data:2,model:2"` -> {"data": 2, "model": 2} (every axis named once).

  Raises:
    ConfigError: an unknown axis, a size that is not a positive integer,
      an axis named twice, or no model or pipeline axis > 1.
  """
  sizes = {}
  for part in str(text).split(","):
    name, colon, size = part.strip().partition(":")
    if not colon or not name:
      raise ConfigError(f"mesh={text!r}: {part.strip()!r} must be axis:size, "
                        "e.g. --mesh=data:2,model:2")
    if name not in AXES:
      raise ConfigError(f"mesh={text!r}: unknown axis {name!r}; the axes "
                        f"are {', '.join(AXES)}")
    if name in sizes:
      raise ConfigError(f"mesh={text!r} names the axis {name!r} twice")
    if not size.strip().isdigit() or int(size) < 1:
      raise ConfigError(f"mesh={text!r}: the size of {name!r} must be a "
                        f"positive integer, got {size!r}")
    sizes[name] = int(size)
  if sizes.get("model", 1) == 1 and sizes.get("pipeline", 1) == 1:
    raise ConfigError(f"mesh={text!r} splits no model (a model or pipeline "
                      "axis > 1); data parallelism alone is "
                      "--strategy=mirrored")
  return sizes


def mesh_size(sizes):
  """The number of devices of a parsed mesh."""
  total = 1
  for size in sizes.values():
    total *= size
  return total


def check_device_count(text, sizes, gpus, cpus):
  """Raises ConfigError unless the mesh's devices are exactly the local
  devices it runs on (the GPUs when there are enough, else the logical
  CPUs)."""
  total = mesh_size(sizes)
  available = gpus if gpus >= total else cpus
  kind = "GPU(s)" if gpus >= total else "logical CPU device(s)"
  if available != total:
    raise ConfigError(
        f"mesh={text} has {total} devices (the product of its axes) but "
        f"this process has {available} {kind}; make them equal (e.g. "
        f"--cpu_devices={total}) or change the mesh")


def worker_count(sizes):
  """Worker tasks a parsed mesh needs on a cluster: its data axis."""
  return sizes.get("data", 1)


def devices_per_task(sizes):
  """Devices of one copy (every axis but data): one worker task's."""
  count = 1
  for axis, size in sizes.items():
    if axis != "data":
      count *= size
  return count


def _index(name):
  return int(name.rsplit(":", 1)[1])


def task_devices(names, task):
  """{"GPU": [...], "CPU": [...]}: worker `task`'s devices in `names`
  (the chief's `tf.config.list_logical_devices()` names), by index."""
  prefix = f"/job:worker/replica:0/task:{task}/device:"
  found = {"GPU": [], "CPU": []}
  for name in names:
    kind = name[len(prefix):].split(":")[0] if name.startswith(prefix) else ""
    if kind in found:
      found[kind].append(name)
  return {kind: sorted(found[kind], key=_index) for kind in found}


def cluster_groups(text, sizes, names):
  """R lists of a copy's devices, list r on worker task r.

  Each task's first GPUs when it has enough of them, else its CPUs.

  Args:
    text: the `--mesh` value (named in errors).
    sizes: the parsed mesh.
    names: the device names the chief sees once connected.
  Raises:
    ConfigError: a worker task with too few devices for one copy.
  """
  count = devices_per_task(sizes)
  groups = []
  for task in range(worker_count(sizes)):
    devices = task_devices(names, task)
    kind = "GPU" if len(devices["GPU"]) >= count else "CPU"
    if len(devices[kind]) < count:
      raise ConfigError(
          f"mesh={text} on a cluster puts one copy of the split on each "
          f"worker task: {count} devices (the axes other than data) each; "
          f"worker {task} has {len(devices['CPU'])} CPU device(s) and "
          f"{len(devices['GPU'])} GPU(s); start the tasks with "
          f"--cpu_devices={count}")
    groups.append(devices[kind][:count])
  return groups


def layers_per_unit(value):
  """Top-level layers per unit of `--shard_parameters` (ZeRO-3) for a
  `--recompute` value: none: 1, every:K: K (each unit is recomputed).

  Raises:
    ConfigError: blocks, attention or true.
  """
  value = parse_recompute(value)
  if value is False:
    return 1
  if isinstance(value, str) and value.startswith("every:"):
    return int(value.split(":")[1])
  raise ConfigError(
      f"shard_parameters=True recomputes each unit of top-level layers (it "
      f"gathers their weights again for the backward pass); "
      f"recompute={'true' if value is True else value} is not such a unit: "
      "use --recompute=none (one layer a unit) or --recompute=every:K (K "
      "layers a unit)")


def parse_recompute(value):
  """A `--recompute` value as the config holds it.

  `False` (`false`, `none`, `--norecompute`): nothing recomputed. `True`
  (`true`, `--recompute` alone): a split model's stages recomputed per
  micro-batch (GPipe's re-materialisation; a split only). `"blocks"`,
  `"attention"`: the model's transformer blocks or attention sublayers,
  split or not; `"every:K"` (K >= 1): each run of K top-level layers of an
  unsplit functional model (`framework.model_parallel.recompute`).

  Raises:
    ConfigError: any other value, naming it and the valid ones.
  """
  if isinstance(value, bool):
    return value
  text = str(value).strip().lower()
  if text in ("true", "false", "none", "blocks", "attention"):
    return {"true": True, "false": False, "none": False}.get(text, text)
  if text.startswith("every:"):
    count = text.split(":", 1)[1]
    # ASCII digits only: str.isdigit accepts other scripts' digits.
    if count.isascii() and count.isdigit() and int(count) >= 1:
      return f"every:{int(count)}"
  raise ConfigError(
      f"recompute={value!r} is not valid; choose one of: none, blocks, "
      "attention, every:K (K an integer >= 1), or true/false (true: a split "
      "model's stages)")


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
  recompute: bool | str = setting(
      False, "Keep fewer activations and recompute them in the backward "
      "pass (less activation memory, one more forward pass of what is "
      "recomputed): none (false, --norecompute); true (--recompute alone): "
      "a split model's stages, per micro-batch; blocks: the model's "
      "transformer blocks; attention: only their attention sublayers; "
      "every:K: each run of K top-level layers of an unsplit functional "
      "model.", parser=parse_recompute)
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
    object.__setattr__(self, "recompute", parse_recompute(self.recompute))
    check_settings(self)


# The models that carry their own whole-model split (a tensor split of every
# block, e.g. models/gpt_parallel.py registers `gpt`), by model name: known
# without loading a split (the split itself loads TensorFlow).
_SPLITS = {}


def register_split(model_name):
  """Decorator: `split(model, devices) -> split model` for models named
  `model_name` (`keras.Model.name`), used by `TensorParallelTrainer`.

  The split model's `call(features)` returns the logit shards; it has
  `devices`, `load_weights_from(model)`, `save_weights_to(model)` (the
  unsplit model's weights), `checkpoint_weights(model)` (its own weight,
  a variable or `ShardedWeight`, for each of the unsplit model's trainable
  variables) and `replicate(devices)` (a copy on other devices, same
  weights).
  """
  def wrap(split):
    _SPLITS[model_name] = split
    return split
  return wrap


def split_for(model):
  """The registered split of `model`, or None (no transformer split)."""
  return _SPLITS.get(getattr(model, "name", None))


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
    recompute: False (none); True: keep only each stage's inputs per
      micro-batch and recompute its forward pass in the backward pass
      (GPipe's re-materialisation); `blocks`, `attention`, `every:K`:
      recomputation without (or within) a split (`parse_recompute`).
    serial_stages: each stage device runs its ops one at a time, in program
      order, as a GPU stream does (`devices.DeviceStreams`).
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
    object.__setattr__(self, "recompute", parse_recompute(self.recompute))
    check_settings(self)
    if self.mesh:
      self._apply_mesh()
    if self.serial_stages and self.mode == "none":
      raise ConfigError("serial_stages orders the ops of each stage of a "
                        "split model; set --model_parallel=pipeline or "
                        "tensor")
    if self.recompute is True and self.mode == "none":
      raise ConfigError("recompute re-runs the stages of a split model in "
                        "the backward pass; set --model_parallel=pipeline "
                        "or tensor (or --recompute=blocks, attention or "
                        "every:K without a split)")
    if str(self.recompute).startswith("every:") and self.mode != "none":
      raise ConfigError(
          f"recompute={self.recompute} recomputes runs of an unsplit "
          f"model's top-level layers; a {self.mode} split runs its own "
          "pieces: use --recompute=blocks, attention or true with "
          "--model_parallel/--mesh (only true or none with "
          "--shard_parameters)")
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

  def check_model(self, model, num_heads, vocab_size, num_layers=None):
    """Raises ConfigError when a tensor split cannot cut `model` (the
    shards must divide a gpt's heads and vocabulary, a tensor x pipeline
    mesh needs a model with a whole split and a block per stage, and so
    does a gpt pipeline, which runs that split); before any build.
    `num_layers` None: not known (not checked)."""
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
    from framework.model_parallel.copies import split_strategy  # pylint: disable=g-import-not-at-top
    count, argument = self.device_count
    strategy, groups = split_strategy(strategy, count, name=name,
                                      argument=argument)
    return dataclasses.replace(
        self, replica_devices=tuple(tuple(g) for g in groups)), strategy

  def _mesh_strategy(self, strategy, name):
    """(config, one-replica strategy) of a `mesh` run: its data axis cut
    from this process's devices (no data-parallel strategy needed)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from framework.model_parallel.copies import replica_groups  # pylint: disable=g-import-not-at-top
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
                            count, strategy_name=name, name=argument)
    return dataclasses.replace(
        self, replica_devices=tuple(tuple(g) for g in groups)), strategy

  def _cluster_mesh_strategy(self, strategy, name):
    """(config, one-replica strategy) of a mesh on a cluster: copy r of the
    split on worker task r's devices (`cluster_groups`); call after
    `devices.start_cluster` connected this chief."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if strategy.num_replicas_in_sync != 1:
      raise ConfigError(
          f"mesh={self.mesh} makes its own data axis; use strategy=default "
          f"(not {name})")
    groups = cluster_groups(
        self.mesh, parse_mesh(self.mesh),
        [d.name for d in tf.config.list_logical_devices()])
    return dataclasses.replace(
        self, replica_devices=tuple(tuple(g) for g in groups)), strategy

  def trainer_factory(self, trainer_cls=None):
    """`trainer_cls` (default `Trainer`) when nothing is split, else the
    split's trainer bound to this config (`tensor_parallel.trainer_factory`,
    which loads the trainers; this module builds none)."""
    if self.mode == "none":
      from framework.core.trainer import Trainer  # pylint: disable=g-import-not-at-top
      return trainer_cls or Trainer
    from framework import model_parallel  # pylint: disable=g-import-not-at-top
    return model_parallel.trainer_factory(self, trainer_cls)
