"""The devices of a split: where its pieces go, what each holds, where its
ops ran, and each running one op at a time.

Where: stage or shard `i` goes on `/GPU:i` when there are enough GPUs,
else on the logical CPU device `/CPU:i` (split the host with
`framework.configure_cpu_devices(n)`); with `cluster` placement on
`/job:worker/task:i` of the TF_CONFIG cluster. The chief runs the training
loop and reaches the workers through TensorFlow's distributed runtime
(`connect_cluster`); each worker only runs a `tf.distribute.Server`.

What each holds (`memory_by_device`): bytes of parameters, optimizer slots
and activations per device. The point of model parallelism is that no
device has to hold the whole model: these figures (logged at start-up and
written to TensorBoard as `memory/<device>/param_bytes`,
`.../optimizer_slot_bytes` and `.../activation_bytes`) show how much each
device holds. Activations are computed, not measured (`get_memory_info`
does not work on CPU devices): the bytes each stage keeps between its
forward and backward pass, from the static shapes of its input and its
layers' outputs, for all M micro-batches (GPipe runs every forward before
any backward, so the whole global batch is in flight). With recomputation
a stage keeps only its inputs; its backward pass then holds one
micro-batch's outputs for a moment on top (not counted). It is an estimate
of what TensorFlow keeps: some ops keep less (a Flatten's output is a
view), some keep their own temporaries.

Where its ops ran (`misplaced_ops`): device scopes are easy to get wrong
silently (an unplaced op runs on device 0 and the step is still correct,
only slower and bigger). `misplaced_ops` reads the traced graph: every op
named under a piece's name scope (forward `stage_1/...`, backward
`gradient_tape/stage_1/...`) must carry that piece's device.

One op at a time (`DeviceStreams`): a GPU runs a stage's kernels on one
stream, one after another. Logical CPU devices have no streams:
TensorFlow's executor runs any ready op on any inter-op thread, so one
stage may run two ops at once (a layer's input and weight gradients) and
hold both cores while the other stage's ready op waits. The pipeline then
has a bubble of its own making, on top of GPipe's. `DeviceStreams`
restores stream semantics inside a `tf.function`: every op created inside
`streams.on(key)` gets a control input from the op created before it on the
same key, so the ops of one key form a single chain in program order.
Program (creation) order is a topological order of the whole graph, so
chains drawn along it never make a cycle; the ops of different keys stay
free to overlap, as two streams do. Within a block, `first` can move the
ops some outputs need ahead of the rest (any order of a block's ops that
keeps its data dependencies, and comes after every earlier block, is still
acyclic: see `_urgent_first`). The cost: a control input on the first op
of a fusable pattern can stop Grappler from fusing it (say MatMul +
BiasAdd), so results may differ from the unchained model in the last bits
(1e-7), and kernels can be a little slower. Off by default;
`PipelineTrainer(serial_stages=True)` turns it on.
"""

import contextlib
import os
import re

import keras
import numpy as np
import tensorflow as tf

from framework import _tf_internal
from framework.errors import ConfigError, check_positive


def model_parallel_devices(count, *, name="num_stages"):
  """The first `count` GPUs, else the first `count` logical CPU devices.

  GPUs are used when there are at least `count` of them; otherwise the
  host's logical CPU devices (e.g. tests on a one-GPU machine).

  Args:
    count: how many devices the split needs.
    name: the argument that asked for them (named in the error).
  Raises:
    ConfigError: fewer than `count` devices of either kind exist.
  """
  check_positive(name, count)
  gpus = len(tf.config.list_logical_devices("GPU"))
  cpus = len(tf.config.list_logical_devices("CPU"))
  if gpus >= count:
    return [f"/GPU:{i}" for i in range(count)]
  if cpus >= count:
    return [f"/CPU:{i}" for i in range(count)]
  raise ConfigError(
      f"{name}={count} needs {count} devices but only {cpus} CPU device(s) "
      f"and {gpus} GPU(s) exist; split the CPU with --cpu_devices={count} "
      "(or use fewer)")


def check_cluster(tf_config, count, *, name="num_stages", per="piece"):
  """Raises ConfigError unless `tf_config` has a chief and `count` workers.

  Args:
    tf_config: the parsed TF_CONFIG (None: unset).
    count: stages or shards (or a mesh's copies), one per worker task.
    name: the argument that sets `count`; per: what one task holds.
  """
  if tf_config is None:
    raise ConfigError(
        "model_parallel_devices=cluster needs TF_CONFIG describing a chief "
        f"and {count} worker tasks; it is not set (start the job with "
        f"scripts/launch.py --workers={count} -- ...)")
  cluster = tf_config["cluster"]
  workers = len(cluster.get("worker", []))
  if "chief" not in cluster:
    raise ConfigError(
        "model_parallel_devices=cluster needs a chief task (it runs the "
        "training loop); TF_CONFIG has none (scripts/launch.py adds one)")
  if workers < count:
    raise ConfigError(
        f"model_parallel_devices=cluster with {name}={count} needs {count} "
        f"worker tasks (one per {per}); TF_CONFIG has {workers}")


def connect_cluster(tf_config):
  """Connects this chief to the cluster's tasks (their devices appear).

  Ops without a device scope stay on the chief.
  """
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(tf_config["cluster"]), task_type="chief",
      task_id=0, rpc_layer="grpc")
  tf.config.experimental_connect_to_cluster(
      resolver, job_name="chief", task_index=0,
      make_master_device_default=False)


def start_cluster(config, tf_config=None):
  """This task's part of a `devices=cluster` split (`ModelParallelConfig`).

  A worker serves the chief until it is stopped, then returns None; the
  chief connects to the workers and returns the TF_CONFIG dict.

  Raises:
    ConfigError: no TF_CONFIG, no chief, too few workers, or a task type
      other than chief and worker.
  """
  # pylint: disable-next=g-import-not-at-top
  from framework.distribute import cluster, tf_config as tf_config_lib
  tf_config = tf_config or tf_config_lib.parse_tf_config()
  count, name = config.device_count
  per = "piece"
  if config.mesh:  # a copy of the split per task (`config.cluster_groups`)
    count, name, per = config.data_axis, f"mesh={config.mesh}: data", "copy"
  check_cluster(tf_config, count, name=name, per=per)
  # A call to a dead worker fails at once instead of retrying forever.
  os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
  task_type = tf_config["task"]["type"]
  if task_type == "worker":
    # The server offers the logical CPU devices of --cpu_devices (a mesh's
    # copy needs several); it does not read tf.config's.
    cpus = tf.config.get_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0])
    cluster.run_server(tf_config, cpu_devices=len(cpus) if cpus else None)
    return None
  if task_type != "chief":
    raise ConfigError(
        f"model_parallel_devices=cluster runs a chief and workers; this "
        f"task is {task_type!r}")
  connect_cluster(tf_config)
  return tf_config


def cluster_devices(count):
  """`/job:worker/replica:0/task:i/device:GPU:0` (or CPU:0), i < count.

  Call after `connect_cluster`; a worker with a GPU gets its first GPU.
  """
  devices = []
  remote = [d.name for d in tf.config.list_logical_devices()]
  for task in range(count):
    prefix = f"/job:worker/replica:0/task:{task}/device:"
    kind = "GPU" if f"{prefix}GPU:0" in remote else "CPU"
    devices.append(f"{prefix}{kind}:0")
  return devices


def short_device(name):
  """`/job:localhost/replica:0/task:0/device:CPU:1` -> `/CPU:1` ('' if unset).

  Devices of other jobs keep their task: `/job:worker/task:1/CPU:0`.
  """
  if not name:
    return ""
  spec = tf.DeviceSpec.from_string(name)
  if spec.device_type is None:
    return name
  device = f"/{spec.device_type.upper()}:{spec.device_index or 0}"
  if spec.job and spec.job != "localhost":
    device = f"/job:{spec.job}/task:{spec.task or 0}{device}"
  return device


def host_device(name):
  """The host of device `name`: its task's `CPU:0` (full name)."""
  spec = tf.DeviceSpec.from_string(name)
  return spec.replace(device_type="CPU", device_index=0).to_string()


def variable_device(variable):
  """The short device of a Keras or TensorFlow variable."""
  if isinstance(variable, keras.Variable):
    variable = variable.value  # the tf.Variable behind a Keras one
  return short_device(variable.device)


_CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")


def _operations(graph):
  """All ops of `graph`, including those of functions it calls."""
  for op in graph.get_operations():
    yield op
    if op.type in _CALL_OPS:
      function = _tf_internal.graph_function(graph, op.get_attr("f").name)
      if function is not None and hasattr(function, "graph"):
        yield from _operations(function.graph)


def ops_by_scope(graph, scopes):
  """`{scope: [op, ...]}`: the ops named under each scope (any nesting)."""
  found = {scope: [] for scope in scopes}
  for op in _operations(graph):
    for scope in scopes:
      # A re-entered relative scope becomes `stage_1_1/`: match it too.
      if re.search(rf"(^|/){re.escape(scope)}(_\d+)?/", op.name):
        found[scope].append(op)
  return found


def _captured_devices(graph):
  """`{placeholder name: device}` of the variables a function captured."""
  devices = {}
  for external, internal in getattr(graph, "captures", []):
    device = getattr(external, "device", "")
    if device:
      devices[internal.op.name] = device
  return devices


def effective_device(op, captured):
  """The device `op` asked for, or (reads of a variable) its variable's.

  Variable reads are created without a device on purpose (TensorFlow's
  `colocate_with(None, ignore_existing=True)`): the placer has to run them
  where the variable lives, so that is their device.
  """
  if op.device:
    return op.device
  if op.name in captured:
    return captured[op.name]
  if op.type == "ReadVariableOp" and op.inputs[0].op.name in captured:
    return captured[op.inputs[0].op.name]
  return ""


def _handle(variable):
  variable = getattr(variable, "value", variable)  # Keras -> tf.Variable
  return variable.handle


def misplaced_ops(graph, devices_by_scope, shared_variables=()):
  """Ops under a scope whose requested device is not that scope's device.

  Args:
    graph: a traced graph, e.g. `tf.function(step).get_concrete_function(
      ...).graph`.
    devices_by_scope: `{"stage_0": "/CPU:0", "stage_1": "/CPU:1"}`.
    shared_variables: variables every piece may read where they live (e.g.
      the optimizer's step counter).
  Returns:
    A list of `"op_name (type) on 'device', expected 'device'"` strings.
  """
  captured = _captured_devices(graph)
  shared_handles = {id(_handle(v)) for v in shared_variables}
  shared = {internal.op.name for external, internal in
            getattr(graph, "captures", []) if id(external) in shared_handles}
  offenders = []
  for scope, ops in ops_by_scope(graph, devices_by_scope).items():
    expected = devices_by_scope[scope]
    for op in ops:
      if op.name in shared or (op.type == "ReadVariableOp" and
                               op.inputs[0].op.name in shared):
        continue
      device = effective_device(op, captured)
      if short_device(device) != expected:
        offenders.append(f"{op.name} ({op.type}) on {device!r}, expected "
                         f"{expected!r}")
  return offenders


def _nbytes(variable):
  return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size


def _optimizer_bookkeeping(optimizer):
  """The step counter and learning-rate variable: not per-parameter slots."""
  ids = {id(optimizer.iterations)}
  learning_rate = _tf_internal.learning_rate_variable(optimizer)
  if learning_rate is not None:
    ids.add(id(learning_rate))
  return ids


def memory_by_device(model, optimizer):
  """`{device: {"param_bytes": n, "optimizer_slot_bytes": n}}`.

  Parameters are all model weights (trainable or not, e.g. BatchNorm
  statistics); slots are the optimizer's per-parameter variables (Adam's
  moments), found on whatever device they were created on (with the state
  sharded over a mesh's data axis, `optimizer_sharding`: this copy's 1/R).
  """
  report = {}

  def add(variable, key):
    entry = report.setdefault(variable_device(variable) or "unplaced",
                              {"param_bytes": 0, "optimizer_slot_bytes": 0})
    entry[key] += _nbytes(variable)

  for weight in model.weights:
    add(weight, "param_bytes")
  bookkeeping = _optimizer_bookkeeping(optimizer)
  # By name too: a mesh copy's optimizer keeps an unused step counter of
  # its own (it counts in copy 0's).
  for variable in _tf_internal.optimizer_slot_variables(optimizer):
    if id(variable) not in bookkeeping:
      add(variable, "optimizer_slot_bytes")
  return dict(sorted(report.items()))


def add_activations(report, stages, global_batch_size, recompute):
  """Adds `activation_bytes` (peak, all micro-batches) per device to `report`.

  Args:
    report: from `memory_by_device`; changed in place.
    stages: the trainer's stages (`activation_bytes(recompute)` per example).
    global_batch_size: B; M micro-batches of B/M are all kept at once.
    recompute: the trainer's (whether stages keep only their inputs).
  """
  for stage in stages:
    for leaf in stage.leaves:
      per_example = getattr(leaf, "activation_bytes", lambda _: None)(
          recompute)
      if per_example is None:
        continue
      entry = report.setdefault(short_device(leaf.device),
                                {"param_bytes": 0, "optimizer_slot_bytes": 0})
      entry["activation_bytes"] = (entry.get("activation_bytes", 0) +
                                   per_example * global_batch_size)
  return report


def memory_metrics(report):
  """The report as flat scalars for TensorBoard (`memory/CPU_1/param_bytes`)."""
  metrics = {}
  for device, entry in report.items():
    tag = device.strip("/").replace(":", "_").replace("/", "_")
    for key, value in entry.items():
      metrics[f"memory/{tag}/{key}"] = float(value)
  return metrics


def format_memory(report):
  """One line per device, e.g. `/CPU:0 params 1.2 MiB, optimizer slots ...`."""
  return "; ".join(
      f"{device}: params {entry['param_bytes']} B, optimizer slots "
      f"{entry['optimizer_slot_bytes']} B" + (
          f", activations {entry['activation_bytes']} B"
          if "activation_bytes" in entry else "")
      for device, entry in report.items())


class _Block:
  """The ops of one `DeviceStreams.on` block; `first` marks urgent outputs."""

  def __init__(self):
    self.urgent = []

  def first(self, *tensors):
    """Runs the ops these tensors need before the block's other ops."""
    self.urgent.extend(t for t in tf.nest.flatten(tensors) if t is not None)


def _urgent_first(ops, urgent):
  """`ops` (in creation order) with the ancestors of `urgent` moved first.

  Still a topological order: the ancestors of a set are closed under
  taking inputs, and each part keeps creation order.
  """
  block = set(ops)
  needed, todo = set(), [t.op for t in urgent if t.op in block]
  while todo:
    op = todo.pop()
    if op in needed:
      continue
    needed.add(op)
    todo.extend(i.op for i in op.inputs if i.op in block)
    todo.extend(c for c in op.control_inputs if c in block)
  return ([op for op in ops if op in needed] +
          [op for op in ops if op not in needed])


class DeviceStreams:
  """Chains the ops created under each key into one sequence."""

  def __init__(self, enabled=True):
    self.enabled = bool(enabled)
    self._last = {}

  @contextlib.contextmanager
  def on(self, key):
    """Ops created in this block run after every earlier op of `key`.

    Yields a block whose `first(tensors)` puts the ops those tensors need
    ahead of the block's other ops: a stage sends its input gradient to the
    stage before it as soon as it is computed, and computes its weight
    gradients after (the B-before-W order of zero-bubble pipelines), so
    the stage before it waits for less. Without `first`, creation order.

    `key` None (e.g. a stage spread over several devices) chains nothing.
    """
    graph = tf.compat.v1.get_default_graph()
    block = _Block()
    if not (self.enabled and key is not None and graph.building_function):
      yield block
      return
    start = len(graph.get_operations())
    yield block
    ops = graph.get_operations()[start:]
    if block.urgent:
      ops = _urgent_first(ops, block.urgent)
    last = self._last.get((graph, key))
    for op in ops:
      if last is not None:
        # No public API adds a control input to an op that already exists
        # (the gradient ops are made inside tape.gradient).
        _tf_internal.add_control_input(op, last)
      last = op
    self._last[(graph, key)] = last
