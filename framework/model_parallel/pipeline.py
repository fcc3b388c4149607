"""Pipeline parallelism: a model's layers cut into stages on S devices.

    layers:   [l_0 ... l_a-1 | l_a ... l_b-1 | ... ]    boundaries (a, b, ...)
    devices:     /CPU:0          /CPU:1        ...

Each stage's variables are created on its device (and so are their optimizer
slots: Keras creates slots colocated with their variable); `StagedTrainer`
runs the forward and backward pass of each stage on its device and streams M
micro-batches through the stages. In this module, in order: where to cut
(`balanced_boundaries`, by each layer's cost), the cut of a functional
model's layer graph (`split_graph`, `GraphStage`), and `PipelineTrainer`.

Costs: a pipeline runs at the pace of its slowest stage, so stages should
get equal WORK, not equal parameters: a big Dense after the convolutions
holds most of a CNN's parameters and little of its compute. `flops` (the
default) counts each layer's forward + backward conv/matmul FLOPs per
example, from its own traced graph (`perf.flops.call_training_flops`: the
layer traced alone on its input shapes; nothing is run); `params` counts
its parameters. FLOPs leave out element-wise layers (BatchNorm,
activations, pooling, adds), which then cost nothing. A layer that cannot
be traced alone counts 0 (logged). Without any FLOPs (no conv or matmul
anywhere) the split falls back to parameter counts.

A functional model (a DAG) has its layers taken in the order Keras itself
runs them (a topological order of the graph) and cut at S-1 points:

    order:   conv0 bn0 relu0 pool0 | conv1 ... up0 concat0 ... logits
    stage:          0              |            1

A tensor that crosses a cut, a skip connection included, is sent from the
stage that made it straight to every later stage that reads it; in the
backward pass the gradients from all its readers are summed (by each
reader's tape, then on the way back), so the producer gets d loss / d tensor
as in the unsplit model. These stages run the ORIGINAL model's layers:
`place_variables` moves each layer's variables onto its stage's device
(same Keras variables, new storage), so the model, its checkpoints and its
saved weights are those of the unsplit model.
"""

from absl import logging
import keras
import tensorflow as tf

from framework import _tf_internal
from framework.errors import ConfigError, check_choice, check_positive
from framework.model_parallel.config import BALANCES, SplitConfig
from framework.model_parallel.devices import model_parallel_devices
from framework.model_parallel.staged_trainer import StagedTrainer
from framework.model_parallel.staged_trainer import (Record, Stage, read_state,
                                             restored_state, state_variables,
                                             tensor_bytes)
from framework.perf.flops import call_training_flops
from framework.settings import default


def balanced_boundaries(sizes, num_stages):
  """Cut points that minimise the largest stage's total of `sizes`.

  Args:
    sizes: per-layer cost (parameter counts), in order.
    num_stages: how many contiguous, non-empty stages.
  Returns:
    A tuple of `num_stages - 1` increasing indices: stage i is
    `layers[bounds[i-1]:bounds[i]]`.
  """
  n = len(sizes)
  prefix = [0]
  for size in sizes:
    prefix.append(prefix[-1] + size)
  # best[k][j]: (largest stage, cuts) for the first j layers in k stages.
  inf = (float("inf"), ())
  best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
  best[0][0] = (0, ())
  for k in range(1, num_stages + 1):
    for j in range(k, n + 1):
      for i in range(k - 1, j):
        worst, cuts = best[k - 1][i]
        candidate = (max(worst, prefix[j] - prefix[i]), cuts + (i,))
        if candidate[0] < best[k][j][0]:
          best[k][j] = candidate
  return best[num_stages][n][1][1:]


def check_boundaries(boundaries, num_layers, num_stages):
  """Raises ConfigError unless `boundaries` cut `num_layers` into stages."""
  boundaries = tuple(boundaries)
  valid = (len(boundaries) == num_stages - 1 and
           all(isinstance(b, int) for b in boundaries) and
           all(0 < b < num_layers for b in boundaries) and
           list(boundaries) == sorted(set(boundaries)))
  if not valid:
    raise ConfigError(
        f"stage_boundaries={list(boundaries)} must be {num_stages - 1} "
        f"strictly increasing layer indices in 1..{num_layers - 1} (cut "
        f"points between the {num_layers} layers)")
  return boundaries


def count_params(layer):
  """Parameters of a built Keras layer (0 for other operations)."""
  return layer.count_params() if isinstance(
      layer, keras.layers.Layer) and layer.built else 0


def call_layer(layer, args, kwargs, training):
  """`layer(*args, **kwargs)`, with `training` if the layer takes it."""
  # As keras.Model's call: `training` only for layers that take it.
  if "training" in _tf_internal.call_context_args(layer):
    kwargs = dict(kwargs, training=training)
  return layer(*args, **kwargs)


def _spec(tensor):
  return tf.TensorSpec([1, *tensor.shape[1:]], tensor.dtype)


def node_flops(node, input_gradient=True):
  """Training FLOPs per example of one Keras call node, traced alone."""
  layer = node.operation
  inputs = list(node.input_tensors)

  def fn(*tensors):
    args, kwargs = node.arguments.fill_in(
        {id(k): t for k, t in zip(inputs, tensors)})
    return call_layer(layer, args, kwargs, training=True)

  # A ranking of the stages: a layer's loop counted once still ranks it.
  return call_training_flops(fn, [_spec(t) for t in inputs],
                             getattr(layer, "trainable_variables", []),
                             input_gradient, outer_ops_only=True)


def node_costs(nodes, balance=default(SplitConfig, "stage_balance")):
  """Per-node cost (`flops` or `params`) of a model's call nodes, in order.

  A node with no trainable layer before it (in this order) needs no input
  gradient (as in the pipeline, whose first stage computes none).
  """
  params = [count_params(node.operation) for node in nodes]
  if balance == "params":
    return params
  costs, trainable_before = [], False
  for node in nodes:
    try:
      costs.append(node_flops(node, input_gradient=trainable_before))
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("stage_balance=flops: cannot trace layer %r alone "
                      "(%s); counting it as 0 FLOPs",
                      node.operation.name, e)
      costs.append(0)
    trainable_before |= bool(getattr(node.operation, "trainable_variables",
                                     None))
  if not any(costs):
    logging.warning("stage_balance=flops: no conv/matmul FLOPs counted; "
                    "balancing by parameter count")
    return params
  return costs


def layer_costs(layers, balance=default(SplitConfig, "stage_balance")):
  """Per-layer cost of a built `keras.Sequential`'s layers, in order."""
  # Keras 3: a layer's node 0 is its call in the Sequential's functional
  # graph (built on an Input).
  return node_costs([_tf_internal.inbound_nodes(layer)[0] for layer in layers],
                    balance)


def is_functional(model):
  """Whether `model` is a Keras functional model (it has a layer graph)."""
  return _tf_internal.has_layer_graph(model)


def graph_nodes(model, once=True):
  """The model's call nodes (inputs excluded), in the order Keras runs them.

  Args:
    once: refuse a layer called more than once (a stage owns its layers).
  Raises:
    ConfigError: not one input and one output, or (`once`) a layer used
      twice.
  """
  if not is_functional(model):
    raise ConfigError(
        f"pipeline parallelism needs a keras.Sequential or functional "
        f"keras.Model (a graph of layers); got {type(model).__name__}, "
        "whose call() Keras cannot cut")
  if len(model.inputs) != 1 or len(model.outputs) != 1:
    raise ConfigError(
        f"pipeline parallelism needs a model with one input and one output; "
        f"{model.name} has {len(model.inputs)} and {len(model.outputs)}")
  nodes = []
  by_depth = _tf_internal.nodes_by_depth(model)
  for depth in sorted(by_depth, reverse=True):
    for node in by_depth[depth]:
      if node.operation is not None and not node.is_input:
        nodes.append(node)
  seen = {}
  for node in nodes if once else ():
    name = node.operation.name
    if id(node.operation) in seen:
      raise ConfigError(
          f"layer {name!r} is called more than once in {model.name}; "
          "pipeline parallelism needs each layer used once")
    seen[id(node.operation)] = name
  return nodes


def resolve_boundaries(boundaries, names):
  """`boundaries` as indices into `names`; a name cuts before that layer.

  Raises:
    ConfigError: a name that is no layer's.
  """
  resolved = []
  for boundary in boundaries:
    if isinstance(boundary, str) and not boundary.lstrip("-").isdigit():
      if boundary not in names:
        shown = ", ".join(names[:40]) + (", ..." if len(names) > 40 else "")
        raise ConfigError(
            f"stage_boundaries: no layer is named {boundary!r}; a name cuts "
            f"before that layer; the layers in order are: {shown}")
      resolved.append(names.index(boundary))
    else:
      resolved.append(int(boundary))
  return tuple(resolved)


def place_variables(layers, device):
  """Moves the variables of `layers` onto `device`, keeping the objects.

  Each Keras variable gets a new TensorFlow variable with the same value on
  `device`; layers, optimizer references and checkpoints keep working since
  the Keras variables are the same objects. Must run before an optimizer
  builds slots for them.
  """
  seen = set()
  for layer in layers:
    for variable in getattr(layer, "variables", ()):
      if id(variable) in seen:
        continue
      seen.add(id(variable))
      value = variable.value
      with tf.init_scope(), tf.device(device):
        _tf_internal.initialize_variable(variable, tf.identity(value))


class GraphStage:
  """A run of graph nodes on one device; tensors in and out by key.

  Stages pass an "environment" `{key: tensor}` down the chain: every tensor
  made so far that a later stage (or the model's output) still needs. A
  stage reads the entries it uses (one copy each onto its device), adds the
  ones it makes, and drops what no later stage reads. Entries it does not
  read pass through untouched (no op: the consumer copies straight from the
  producer's device).

  Args:
    name: name scope of the stage's ops (`stage_1`).
    device: where its variables live and its ops run.
    nodes: its call nodes, in order.
    input_key: key of the model's input (the first stage receives it bare).
    incoming: keys of the environment this stage receives.
    outgoing: keys it passes on (the last stage: the model's output key,
      returned bare).
  """

  # ZeRO-3 on the data axis: a `copy_parameter_sharding.StageShards` (set
  # by the trainer), as `Stage.shards`.
  shards = None

  def __init__(self, name, device, nodes, *, incoming, outgoing, last):
    self.name = name
    self.device = device
    self.nodes = list(nodes)
    self.layers = [n.operation for n in self.nodes]
    self.incoming = list(incoming)
    self.outgoing = list(outgoing)
    self.last = last
    made = {id(t) for n in self.nodes for t in n.outputs}
    used = {id(t) for n in self.nodes for t in n.input_tensors}
    self.reads = [k for k in self.incoming if k in used]
    self.makes = [k for k in self.outgoing if k in made]

  @property
  def trainable_variables(self):
    seen, variables = set(), []
    for layer in self.layers:
      for v in getattr(layer, "trainable_variables", ()):
        if id(v) not in seen:
          seen.add(id(v))
          variables.append(v)
    return variables

  @property
  def leaves(self):
    return [self]

  def _environment(self, x):
    return x if isinstance(x, dict) else {self.incoming[0]: x}

  def _run(self, local, training):
    """Runs the nodes on the tensors in `local` (filled in place)."""
    for node in self.nodes:
      args, kwargs = node.arguments.fill_in(local)
      if self.shards is None:
        outputs = call_layer(node.operation, args, kwargs, training)
      else:  # ZeRO-3: a layer's weights joined per call
        outputs = self.shards.call(
            node.operation,
            lambda *a, layer=node.operation, **k: call_layer(
                layer, a, k, training), args, kwargs)
      for key, value in zip(node.outputs, tf.nest.flatten(outputs)):
        local[id(key)] = value

  def _outputs(self, env, local):
    if self.last:
      return local[self.outgoing[0]]
    return {k: local[k] if k in self.makes else env[k] for k in self.outgoing}

  def apply(self, x, training=False):
    """The forward pass on `device`, not recorded (evaluation)."""
    env = self._environment(x)
    with tf.device(self.device), tf.name_scope(self.name + "/"):
      local = {k: tf.identity(env[k]) for k in self.reads}
      self._run(local, training)
      return self._outputs(env, local)

  def _target(self, local, outputs, head):
    if self.last:
      return head(outputs) if head is not None else outputs
    return [local[k] for k in self.makes]

  def forward(self, x, training=True, head=None, after=(),
              recompute=default(SplitConfig, "recompute")):
    """(outputs, record), as `Stage.forward`; outputs are an environment."""
    env = self._environment(x)
    with tf.device(self.device), tf.name_scope(self.name + "/"):
      with tf.control_dependencies(after):
        inputs = {k: tf.identity(env[k]) for k in self.reads}
      if recompute:
        state = read_state(state_variables(self.layers))
        local = self._run_layers(inputs, training)
        outputs = self._outputs(env, local)
        target = self._target(local, outputs, head)
        return outputs, Record(None, inputs, target, state, head, training)
      with tf.GradientTape() as tape:
        tape.watch(inputs)
        local, weights = self._run_layers(inputs, training, tape,
                                          keep_writes=True)
        outputs = self._outputs(env, local)
        target = self._target(local, outputs, head)
    return outputs, Record(tape, inputs, target, weights=weights)

  def _run_layers(self, inputs, training, tape=None, keep_writes=None):
    """The nodes run on `inputs` (the filled environment), on the layers'
    variables or with `shards` on weights joined from them where read,
    once the inputs exist (`StageShards.run`); with a `tape`,
    (environment, the shard tensors the tape watches, or None)."""
    def run():
      local = dict(inputs)
      self._run(local, training)
      return local
    if self.shards is None:
      return run() if tape is None else (run(), None)
    local, weights = self.shards.run(run, list(inputs.values()), tape,
                                     keep_writes)
    return local if tape is None else (local, weights)

  def _recompute(self, record, grads_out):
    """The record `forward` would have kept, by running it again."""
    # Starts once the output gradient exists: in the backward pass.
    with tf.control_dependencies(tf.nest.flatten(grads_out)):
      inputs = {k: tf.identity(v) for k, v in record.inputs.items()}
    with restored_state(state_variables(self.layers), record.state):
      with tf.GradientTape() as tape:
        tape.watch(inputs)
        local, weights = self._run_layers(inputs, record.training, tape)
        outputs = local[self.outgoing[0]] if self.last else None
        target = self._target(local, outputs, record.head)
    return Record(tape, inputs, target, weights=weights)

  def activation_bytes(self,
                       recompute=default(SplitConfig, "recompute")):
    """Bytes per example kept for backward: inputs read (+ node outputs)."""
    tensors = {id(t): t for n in self.nodes for t in n.input_tensors}
    kept = [tensors[k] for k in self.reads]
    if not recompute:
      kept += [t for n in self.nodes for t in n.outputs]
    return sum(tensor_bytes(t) for t in kept)

  def backward(self, record, output_grad, input_grad=True, after=()):
    """(d environment in, [d variable]) on `device`.

    `output_grad` is d loss / d (the environment passed on); a tensor this
    stage read and also passed on gets the sum of both gradients.
    """
    del after  # data dependencies order the backward pass
    variables = self.trainable_variables
    with tf.device(self.device), tf.name_scope(self.name + "/"):
      if self.last:
        grads_out = (tf.ones_like(record.target) if output_grad is None
                     else output_grad)
      else:
        grads_out = [output_grad[k] for k in self.makes]
      if record.tape is None:
        record = self._recompute(record, grads_out)
      if record.weights is not None:
        variables = record.weights
      input_grads, variable_grads = record.tape.gradient(
          record.target, [record.inputs, variables],
          output_gradients=grads_out,
          unconnected_gradients=tf.UnconnectedGradients.ZERO)
      if not input_grad:
        return None, variable_grads
      passed = {} if self.last else {k: output_grad[k] for k in self.outgoing
                                     if k not in self.makes}
      grads_in = {}
      for k in self.incoming:
        parts = ([input_grads[k]] if k in input_grads else []) + (
            [passed[k]] if k in passed else [])
        grads_in[k] = parts[0] if len(parts) == 1 else tf.add_n(parts)
    return grads_in, variable_grads


def split_graph(model, num_stages,
                boundaries=default(SplitConfig, "stage_boundaries"),
                balance=default(SplitConfig, "stage_balance")):
  """(node groups, boundaries): the graph's nodes cut into `num_stages`.

  Args:
    boundaries: S-1 cut points: node indices or layer names (a name cuts
      before that layer); default: balanced by `balance`.
    balance: without `boundaries`, what the stages share equally:
      `flops` (forward + backward FLOPs per layer) or `params`.
  Raises:
    ConfigError: bad boundaries, or more stages than layers.
  """
  nodes = graph_nodes(model)
  names = [n.operation.name for n in nodes]
  if num_stages > len(nodes):
    raise ConfigError(
        f"num_stages={num_stages} is more than the model's {len(nodes)} "
        f"layers; use at most {len(nodes)} stages")
  if boundaries:
    boundaries = check_boundaries(resolve_boundaries(boundaries, names),
                                  len(nodes), num_stages)
  else:
    boundaries = balanced_boundaries(node_costs(nodes, balance), num_stages)
  edges = (0, *boundaries, len(nodes))
  return [nodes[a:b] for a, b in zip(edges, edges[1:])], tuple(boundaries)


def graph_stages(model, groups, devices, name_prefix=""):
  """`GraphStage`s for the node `groups` on `devices` (variables moved).

  Stage i is named `<name_prefix>stage_<i>` (its ops' name scope).
  """
  input_key = id(model.inputs[0])
  output_key = id(model.outputs[0])
  # For each cut: the tensors made before it and read after it.
  made_before = {input_key}
  stages = []
  incoming = [input_key]
  for i, (group, device) in enumerate(zip(groups, devices)):
    last = i == len(groups) - 1
    made_before |= {id(t) for n in group for t in n.outputs}
    if last:
      outgoing = [output_key]
    else:
      later = {id(t) for g in groups[i + 1:] for n in g for t in n.input_tensors}
      later.add(output_key)
      order = [input_key] + [id(t) for g in groups[:i + 1] for n in g
                             for t in n.outputs]
      outgoing = [k for k in order if k in made_before and k in later]
    stage = GraphStage(f"{name_prefix}stage_{i}", device, group,
                       incoming=incoming,
                       outgoing=outgoing, last=last)
    place_variables(stage.layers, device)
    stages.append(stage)
    incoming = outgoing
  return stages


def model_layers(model, split="pipeline parallelism"):
  """The ordered layers of a `keras.Sequential` (its Input excluded);
  `split` names what needs them in the error."""
  if not isinstance(model, keras.Sequential):
    raise ConfigError(
        f"{split} needs a keras.Sequential model (an ordered "
        f"list of layers); got {type(model).__name__}")
  return list(model.layers)


def split_layers(layers, num_stages,
                 boundaries=default(SplitConfig, "stage_boundaries"),
                 balance=default(SplitConfig, "stage_balance")):
  """Cuts `layers` into `num_stages` lists (balanced by `balance`:
  forward + backward FLOPs or parameter count, see `node_costs`).

  Raises:
    ConfigError: more stages than layers, or bad `boundaries`.
  """
  check_positive("num_stages", num_stages)
  if num_stages > len(layers):
    raise ConfigError(
        f"num_stages={num_stages} is more than the model's {len(layers)} "
        f"layers; use at most {len(layers)} stages")
  if boundaries:
    boundaries = check_boundaries(
        resolve_boundaries(boundaries, [layer.name for layer in layers]),
        len(layers), num_stages)
  else:
    boundaries = balanced_boundaries(layer_costs(layers, balance),
                                     num_stages)
  edges = (0, *boundaries, len(layers))
  return [layers[a:b] for a, b in zip(edges, edges[1:])]


def place_sequential(model, groups, devices):
  """A copy of `model` whose layer group i has its variables on devices[i].

  The copy has the same layers (names, configs, weights) in the same order,
  so its checkpoints are interchangeable with the unsplit model's.
  """
  x = keras.Input(shape=model.input_shape[1:], dtype=model.inputs[0].dtype)
  placed_groups = []
  for group, device in zip(groups, devices):
    placed = []
    # The model's name scope keeps variable paths (mlp/dense/kernel) as in
    # the unsplit model.
    with tf.device(device), keras.name_scope(model.name):
      for layer in group:
        copy = type(layer).from_config(layer.get_config())
        x = copy(x)  # builds the copy: its variables are created here
        copy.set_weights(layer.get_weights())
        placed.append(copy)
    placed_groups.append(placed)
  layers = [layer for group in placed_groups for layer in group]
  inputs = keras.Input(shape=model.input_shape[1:],
                       dtype=model.inputs[0].dtype)
  return keras.Sequential([inputs, *layers], name=model.name), placed_groups


class PipelineTrainer(StagedTrainer):
  """Trains a model cut into `num_stages` stages on as many devices.

  A `keras.Sequential` is copied onto the stage devices (`self.model` is the
  copy, same layers, names and weights); a functional `keras.Model` (any
  graph of layers, skip connections included) keeps its own layers, whose
  variables move to their stage's device (`self.model` is the model).

  Args:
    model: a built `keras.Sequential` or functional `keras.Model` (e.g. from
      `models.build_model`).
    optimizer, strategy: as for `Trainer` (one replica).
    num_stages: S, the number of stages and devices.
    num_microbatches: M, micro-batches per global batch (GPipe).
    stage_boundaries: S-1 cut points: indices into the layers (in the order
      Keras runs them) or layer names (a name starts a stage); default:
      balanced by `stage_balance`.
    stage_balance: `flops` (each layer's forward + backward conv/matmul
      FLOPs, see `node_costs`) or `params` (parameter count).
    recompute: keep only each stage's inputs per micro-batch and recompute
      its forward pass in backward (see `StagedTrainer`).
    serial_stages: each stage device runs its ops one at a time, in program
      order, as a GPU stream does (see `StagedTrainer`).
    devices: S device names; default `/GPU:0..` or `/CPU:0..`.
    replica_devices: data x pipeline: R lists of S devices (e.g. from
      `copies.split_strategy`); copy r of the pipeline runs on list r
      (copy 0, the model, on list 0; `devices` must then be unset). See
      `StagedTrainer`'s `copies`.
    **kwargs: `Trainer` arguments.
  """

  def __init__(self, model, optimizer, strategy, *,
               num_stages=default(SplitConfig, "num_stages"),
               num_microbatches=default(SplitConfig, "num_microbatches"),
               stage_boundaries=default(SplitConfig, "stage_boundaries"),
               devices=None,
               stage_balance=default(SplitConfig, "stage_balance"),
               replica_devices=None, **kwargs):
    check_choice("stage_balance", stage_balance, BALANCES)
    if replica_devices:
      if devices:
        raise ValueError("set devices or replica_devices, not both")
      devices = replica_devices[0]
      if num_stages * len(replica_devices) != sum(map(len, replica_devices)):
        raise ConfigError(f"replica_devices={replica_devices} must be lists "
                          f"of num_stages={num_stages} devices")
    sequential = isinstance(model, keras.Sequential)
    if sequential:
      groups = split_layers(model_layers(model), num_stages, stage_boundaries,
                            stage_balance)
    else:
      groups, self.boundaries = split_graph(model, num_stages,
                                            stage_boundaries, stage_balance)
    devices = list(devices or model_parallel_devices(num_stages))
    if len(devices) != num_stages:
      raise ConfigError(f"devices={devices} must name num_stages="
                        f"{num_stages} devices")
    # The copies' optimizers hold their slots; the learning rate (a
    # schedule, perhaps) is always copy 0's.
    copy_config = dict(optimizer.get_config(), learning_rate=0.0)
    if not sequential:
      with strategy.scope():
        stages = graph_stages(model, groups, devices)
      copies = []
      for r, copy_devices in enumerate((replica_devices or [])[1:], 1):
        # A clone of the graph (same layers, names and weights), cut at
        # the same nodes, its variables on copy r's devices.
        with strategy.scope():
          try:
            clone = keras.models.clone_model(model)
          except (ValueError, TypeError, NotImplementedError) as e:
            # E.g. a Lambda of a Python lambda, which Keras's safe mode
            # will not rebuild from its config.
            reason = str(e).strip().splitlines()[0] if str(e).strip() else (
                type(e).__name__)
            raise ConfigError(
                f"model={model.name}: the {len(replica_devices)} copies of "
                "a pipeline on a data axis are clones of the Keras graph, "
                f"and cloning it failed: {reason} (use layers that clone "
                "from their get_config, e.g. a Layer subclass instead of a "
                "Lambda, or a mesh without a data axis)") from e
          clone.set_weights(model.get_weights())
          clone_groups, _ = split_graph(clone, num_stages, self.boundaries)
          copies.append((graph_stages(clone, clone_groups, copy_devices,
                                      name_prefix=f"copy_{r}_"),
                         clone, type(optimizer).from_config(copy_config)))
      super().__init__(model, optimizer, strategy, stages=stages,
                       num_microbatches=num_microbatches, copies=copies,
                       **kwargs)
      return
    with strategy.scope():
      placed, placed_groups = place_sequential(model, groups, devices)
    self.boundaries = tuple(
        sum(len(g) for g in groups[:i]) for i in range(1, num_stages))
    stages = [Stage(f"stage_{i}", device, group)
              for i, (device, group) in enumerate(zip(devices,
                                                      placed_groups))]
    copies = []
    for r, copy_devices in enumerate((replica_devices or [])[1:], 1):
      # The same layers and weights again, on copy r's devices.
      with strategy.scope():
        copy, copy_groups = place_sequential(model, groups, copy_devices)
        copy_optimizer = type(optimizer).from_config(copy_config)
      copies.append(([Stage(f"copy_{r}_stage_{i}", device, group)
                      for i, (device, group) in enumerate(
                          zip(copy_devices, copy_groups))],
                     copy, copy_optimizer))
    super().__init__(placed, optimizer, strategy, stages=stages,
                     num_microbatches=num_microbatches, copies=copies,
                     **kwargs)
