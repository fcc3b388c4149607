"""Every private TensorFlow / Keras API distloop uses, in one place.

Each function below reaches into TensorFlow 2.21 / Keras 3.15 internals
because the public API lacks what it needs (the comment names what is
missing). tests/test_tf_internal.py checks each against the pinned versions
and fails naming the function when an upgrade moves one. Nothing else in
framework/, models/ or scripts/ imports `tensorflow.python` or `keras.src`,
reads a private attribute of a TensorFlow or Keras object (by name or by
string `getattr`), or matches a Keras-internal variable name.
"""

# pylint: disable=protected-access,g-direct-tensorflow-import
import importlib

import keras
import tensorflow as tf

# --- Keras optimizers (core/optimizers.py, trainer.py, optimizer_sharding.py).


def optimizer_variable_index(optimizer, variable):
  """The index of `variable` in the optimizer's per-variable slot lists.
  Missing publicly: a slot lookup by variable (Keras 3's `variables` is one
  flat list)."""
  return optimizer._get_variable_index(variable)


def adam_slots(optimizer, index):
  """(first moment, second moment) of variable `index` of an Adam/AdamW.
  Missing publicly: named slots (Keras 3 keeps them in private lists)."""
  return optimizer._momentums[index], optimizer._velocities[index]


def learning_rate_variable(optimizer):
  """The optimizer's learning-rate variable, or None when it follows a
  schedule. Missing publicly: `optimizer.learning_rate` reads the value (a
  schedule's too), not the variable that holds it."""
  learning_rate = getattr(optimizer, "_learning_rate", None)
  return learning_rate if hasattr(learning_rate, "assign") else None


def share_step_counter(optimizer, iterations):
  """Makes `optimizer` count its steps in `iterations` (another optimizer's
  counter), before it is built. Missing publicly: `iterations` is
  read-only (Keras keeps the variable in `_iterations`)."""
  # Keras's __setattr__ would track it as a new variable.
  object.__setattr__(optimizer, "_iterations", iterations)


def optimizer_slot_variables(optimizer):
  """The optimizer's per-variable slots: its variables other than its own
  step counter and learning rate (Keras 3.15 names them `iteration` and
  `learning_rate`). Missing publicly: a list of the slots alone."""
  return [v for v in optimizer.variables
          if v.name not in ("iteration", "learning_rate")]


def unbuild_optimizer(optimizer):
  """Drops a built optimizer's slots, so that `optimizer.build(variables)`
  builds it again, over other variables, as if it had never been built
  (the same variables, the same checkpoint keys). Only before its first
  step: the slots' values are lost. Missing publicly: Keras builds an
  optimizer once (`build` returns when `built`)."""
  own = [v for v in optimizer.variables
         if v.name in ("iteration", "learning_rate")]
  tracker = optimizer._tracker
  # A new list, not the old one emptied: TensorFlow refuses to checkpoint a
  # tracked list whose elements were removed. Assigned while Keras's
  # tracker is away, as in the optimizer's __init__ (it would wrap it).
  del optimizer.__dict__["_tracker"]
  optimizer._variables = []
  optimizer.__dict__["_tracker"] = tracker
  tracker.config["variables"] = (tracker.config["variables"][0],
                                 optimizer._variables)
  tracker.stored_ids["variables"] = set()
  for v in own:
    optimizer._track_variable(v)
  optimizer._trainable_variables = []
  optimizer._trainable_variables_indices = {}
  optimizer.built = False


def uses_weight_decay(optimizer, variable):
  """Whether `optimizer`'s weight decay applies to `variable` (its
  `exclude_from_weight_decay` lists). Missing publicly: the query."""
  return optimizer._use_weight_decay(variable)


def trackable_children(obj):
  """{name: child} of what a checkpoint saves under `obj` (an optimizer:
  its variable lists, iterations, learning rate). Missing publicly: the
  object graph of a checkpoint, by name, before it is written."""
  return dict(obj._trackable_children())


class SavedAsVariable(tf.__internal__.tracking.Trackable):
  """A checkpoint node that saves `save()` (a tensor) and restores through
  `restore(tensor)`, under the key a variable's value has, so that a
  variable and this read each other's checkpoints. Missing publicly: a
  checkpointed value computed at save time (`tf.train.experimental.
  PythonState` saves strings, not tensors of a variable's key)."""

  def __init__(self, save, restore, shape=None):
    self._save_value, self._restore_value = save, restore
    self.shape = shape  # the saved value's (a sharded slot's full shape)

  @property
  def value(self):
    """The value a checkpoint saves (as a variable's `value` reads)."""
    return self._save_value()

  def assign(self, value):
    """Restores `value` (as a variable's `assign` sets it)."""
    return self._restore_value(value)

  def _serialize_to_tensors(self):
    return {VARIABLE_VALUE_KEY: self._save_value()}

  def _restore_from_tensors(self, restored_tensors):
    value = restored_tensors[VARIABLE_VALUE_KEY]
    if self.shape is not None:
      # Restored inside a multi-worker function the value has no static
      # shape, which splitting it needs.
      value = tf.ensure_shape(value, self.shape)
    return self._restore_value(value)


# --- tf.distribute (core/ps_training.py, model_parallel/copies.py). -----------


def num_workers(strategy):
  """The worker count of a connected ParameterServerStrategy. Missing
  publicly: its `cluster_resolver` is None once connected."""
  return strategy._num_workers


# Not converted: the model-parallel all-reduces are built on first use, which
# can be inside a traced step, and AutoGraph cannot read importlib's source.
@tf.autograph.experimental.do_not_convert
def _distribute_module(name):
  return importlib.import_module(f"tensorflow.python.distribute.{name}")


def collective_all_reduce(devices, collective_keys):
  """TensorFlow's CollectiveAllReduce over `devices` (one per group).
  Missing publicly: a cross-device all-reduce over chosen devices outside a
  strategy's replicas (tf.distribute only reduces over its own replicas)."""
  return _distribute_module("cross_device_ops").CollectiveAllReduce(
      devices=list(devices), group_size=len(devices),
      options=tf.distribute.experimental.CommunicationOptions(),
      collective_keys=collective_keys)


def collective_keys(group_key_start=1_000_000):
  """A fresh CollectiveKeys (group and instance keys of collectives).
  Missing publicly: as for `collective_all_reduce`.

  Its group keys start far above the ones a MirroredStrategy's own
  all-reduce numbers from 1: the runtime remembers each (group, instance)
  pair's shape, so a shared key fails the later collective.
  """
  return _distribute_module("cross_device_utils").CollectiveKeys(
      group_key_start=group_key_start)


@tf.autograph.experimental.do_not_convert
def collective_launcher(devices, group_size, collective_keys):
  """{device: a CollectiveReplicaLauncher} for each of this process's
  `devices`, in one group of `group_size` replicas (all processes' devices).
  Missing publicly: collectives other than all-reduce and all-gather over
  a strategy's replicas (tf.distribute has no reduce-scatter or all-to-all).
  The launcher gives each call a fresh instance key at call time and orders
  one device's collectives with a token, as the strategies' own do."""
  utils = _distribute_module("cross_device_utils")
  group_key = collective_keys.get_group_key(list(devices))
  options = _distribute_module("collective_util").Options()
  return {device: utils.CollectiveReplicaLauncher(
      group_key, group_size, collective_keys, device, options)
          for device in devices}


@tf.autograph.experimental.do_not_convert
def all_to_all(launcher, value):
  """`launcher`'s replica sends `value[i]` to replica i and receives
  replica i's piece for it as row i (`value`'s first dimension is the
  group size). Missing publicly: the collective all-to-all
  (CollectiveAllToAllV2, CPU and GPU kernels) has no tf.distribute API."""
  collective_ops = importlib.import_module(
      "tensorflow.python.ops.collective_ops")
  instance_key = launcher._next_instance_key()
  token = launcher._get_ordering_token()
  with tf.device(launcher._device):
    return collective_ops.all_to_all_v2(
        value, launcher._group_size, launcher._group_key, instance_key,
        ordering_token=token)


def per_replica(values):
  """`values` as a PerReplica (one per device). Missing publicly: building
  one outside a strategy's `run`."""
  return _distribute_module("values").PerReplica(tuple(values))


# --- Checkpoints (model_parallel/parallel_layers.py). ------------------------

# The base class of objects a tf.train.Checkpoint saves, for a weight kept as
# shards that saves itself as slices of one tensor. Missing publicly: the
# Trackable protocol (`_serialize_to_tensors`) has no public base class.
Trackable = tf.__internal__.tracking.Trackable
# The attribute name under which a variable's value is checkpointed
# (`<path>/.ATTRIBUTES/VARIABLE_VALUE`). Missing publicly: the constant.
VARIABLE_VALUE_KEY = importlib.import_module(
    "tensorflow.python.trackable.base").VARIABLE_VALUE_KEY


# --- Graphs (model_parallel/devices.py: streams, placement checks). -----------


def add_control_input(op, dependency):
  """Makes the existing `op` run after `dependency`. Missing publicly:
  `tf.control_dependencies` only applies to ops created inside it (the
  gradient ops are created inside `tape.gradient`)."""
  op._add_control_input(dependency)


def graph_function(graph, name):
  """The function `name` defined in `graph` (that a call op calls), or
  None. Missing publicly: a FuncGraph's library lookup."""
  return graph._get_function(name)


# --- Keras functional models (model_parallel/, check/). -----------------------


def has_layer_graph(model):
  """Whether `model` is a Keras functional model (it has a graph of layer
  calls; a subclassed model has none). Missing publicly: the query."""
  return hasattr(model, "_nodes_by_depth") and hasattr(model, "inputs")


def call_context_args(layer):
  """The call-context arguments (e.g. `training`) that `layer`'s `call`
  takes; () for an operation that is no Layer. Missing publicly: Keras
  decides per layer which of them its call receives."""
  return getattr(layer, "_call_context_args", ())


def nodes_by_depth(model):
  """{depth: [keras node]} of a functional model (inputs deepest).
  Missing publicly: the graph of layer calls (`model.operations` has no
  edges)."""
  return model._nodes_by_depth


def inbound_nodes(layer):
  """The layer's calls (keras nodes) in the functional graphs it is in.
  Missing publicly: as for `nodes_by_depth`."""
  return layer._inbound_nodes


def flatten_layers(model):
  """Every layer inside `model`, nested ones included (not the model).
  Missing publicly: `model.layers` lists only the top level."""
  return list(model._flatten_layers(include_self=False))


def variable_handle(variable):
  """The resource tensor of a Keras variable's tf.Variable, as a
  `tf.function` captures it when it reads the variable. Missing publicly:
  a variable's handle."""
  return variable.value.handle


def stored_value(variable):
  """The value a Keras variable holds, read past any `keras.StatelessScope`
  (as Keras reads it outside one). Missing publicly: reading a variable
  inside a stateless scope without the scope's value."""
  return tf.convert_to_tensor(variable._value)


def initialize_variable(variable, value):
  """(Re)creates a Keras variable's backing tf.Variable from `value` under
  the current device scope (to place it). Missing publicly: placing an
  existing Keras variable on a device."""
  variable._initialize(value)


# The name Keras gives every SeedGenerator's state variable (Dropout's and
# the random layers'). Missing publicly: a way to find those variables (they
# are non-trainable weights like BatchNorm's statistics).
SEED_GENERATOR_STATE = "seed_generator_state"


def is_seed_generator_state(variable):
  """Whether `variable` is a Keras SeedGenerator's state (a random layer's,
  not a statistic to average or an input to a step)."""
  return variable.name == SEED_GENERATOR_STATE


_STATELESS_SCOPE = importlib.import_module(
    "keras.src.backend.common.stateless_scope")


def stateless_scope():
  """The `keras.StatelessScope` Keras reads variables through now, or None.
  Missing publicly: the active scope (only the class is exported)."""
  return _STATELESS_SCOPE.get_stateless_scope()


# The attributes under which Keras 3.15's random layers keep their
# SeedGenerator: `seed_generator` (Dropout, the noise layers, Attention),
# `generator` (the preprocessing layers: RandomFlip, RandomCrop, ...).
SEED_GENERATOR_ATTRIBUTES = ("seed_generator", "generator")


def has_seed_generator(layer):
  """Whether `layer` draws random numbers from a Keras SeedGenerator of its
  own. Missing publicly: a query for a layer's randomness (Keras's random
  layers keep it under conventional attribute names)."""
  return any(isinstance(getattr(layer, name, None), keras.random.SeedGenerator)
             for name in SEED_GENERATOR_ATTRIBUTES)


# --- Preemption (core/actions.py). -------------------------------------------


def stop_peer_watcher(handler):
  """Ends a PreemptionCheckpointHandler's thread that watches its peers'
  termination (if it has one). Missing publicly: the handler stops it only
  in `__del__`."""
  stop = getattr(handler, "_stop_cluster_wise_termination_watcher_thread",
                 None)
  if stop is not None:
    stop()


# The threads a PreemptionCheckpointHandler starts, by the names TensorFlow
# gives them (failure_handling.py).
PREEMPTION_THREAD_PREFIXES = ("PeerTerminationWatcher-",
                              "WorkerTerminationSignalWatcher-")


def is_preemption_thread(thread):
  """Whether `thread` is one a PreemptionCheckpointHandler started. Missing
  publicly: the handler's threads are neither exposed nor guarded against
  a lost coordination service."""
  name = getattr(thread, "name", "") or ""
  return name.startswith(PREEMPTION_THREAD_PREFIXES)


# --- Random ops (check/distribution_step.py). ---------------------------------

# The generated op modules whose functions the self-check wraps to make
# random draws equal on N replicas and one device. Missing publicly: a hook
# on op creation (tf.random and Keras call these module functions).
_RANDOM_OP_MODULES = ("gen_random_ops", "gen_stateful_random_ops",
                      "gen_stateless_random_ops",
                      "gen_stateless_random_ops_v2")


def random_op_module(name):
  """The `tensorflow.python.ops.<name>` module (one of the random ones)."""
  if name not in _RANDOM_OP_MODULES:
    raise ValueError(f"{name} is not one of {_RANDOM_OP_MODULES}")
  return importlib.import_module(f"tensorflow.python.ops.{name}")


# --- The runtime (scripts/cli.py). -------------------------------------------


def onednn_enabled():
  """Whether TensorFlow runs its oneDNN CPU kernels in this process.
  Missing publicly: TensorFlow logs it once at start-up and exposes no
  query."""
  from tensorflow.python.util import _pywrap_util_port
  return bool(_pywrap_util_port.IsMklEnabled())


# --- The coordination service (distribute/cluster.py). ------------------------


def coordination_service_configured():
  """Whether this process's eager context has a coordination service.
  Missing publicly: `tf.config` does not expose it."""
  from tensorflow.python.eager import context
  return context.context().coordination_service is not None


def configure_coordination_service(spec, jobs, heartbeat_timeout_ms):
  """Configures MultiWorkerMirroredStrategy's coordination service for
  `jobs` (name -> task count) of cluster `spec`, as the strategy would, with
  another heartbeat timeout. Missing publicly: the timeout (the strategy
  hard-codes its own)."""
  from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
  from tensorflow.python.distribute import multi_worker_util
  from tensorflow.python.eager import context
  coordinated = [coordination_config_pb2.CoordinatedJob(name=n, num_tasks=k)
                 for n, k in jobs.items()]
  context.context().configure_coordination_service(
      service_type="standalone",
      service_leader=multi_worker_util.coordination_leader(spec),
      heartbeat_timeout_in_ms=heartbeat_timeout_ms,
      coordinated_jobs=coordinated)


# --- Checkpoint object graphs (core/checkpoints/warm_start.py). ---------------


def checkpoint_object_graph(reader):
  """The `TrackableObjectGraph` proto of the TF2 checkpoint `reader` reads
  (`tf.train.load_checkpoint`). Missing publicly: which object path (e.g.
  model/_functional/_operations/2/_kernel) a key belongs to; a checkpoint
  keys a variable by its first path from the root, which is often the
  optimizer's list, not the model's."""
  from tensorflow.core.protobuf import trackable_object_graph_pb2
  graph = trackable_object_graph_pb2.TrackableObjectGraph()
  graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
  return graph
