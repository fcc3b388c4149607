"""Pipeline stages cut from a functional Keras model's layer graph (a DAG).

The layers are taken in the order Keras itself runs them (a topological
order of the graph) and cut at S-1 points into S stages:

    order:   conv0 bn0 relu0 pool0 | conv1 ... up0 concat0 ... logits
    stage:          0              |            1

A tensor that crosses a cut — a skip connection included — is sent from the
stage that made it straight to every later stage that reads it; in the
backward pass the gradients from all its readers are summed (by each
reader's tape, then on the way back), so the producer gets d loss / d tensor
as in the unsplit model.

The stages run the ORIGINAL model's layers: `place_graph` moves each layer's
variables onto its stage's device (same Keras variables, new storage), so
the model, its checkpoints and its saved weights are those of the unsplit
model.
"""

import tensorflow as tf

from framework import _tf_internal
from framework.errors import ConfigError
from framework.model_parallel.boundaries import (balanced_boundaries,
                                                 check_boundaries)
from framework.model_parallel.costs import call_layer, node_costs
from framework.model_parallel.split_config import SplitConfig
from framework.settings import default
from framework.model_parallel.stages import (Record, read_state,
                                             restored_state, state_variables,
                                             tensor_bytes)


def is_functional(model):
  """Whether `model` is a Keras functional model (it has a layer graph)."""
  return _tf_internal.has_layer_graph(model)


def graph_nodes(model):
  """The model's call nodes (inputs excluded), in the order Keras runs them.

  Raises:
    ConfigError: not one input and one output, or a layer used twice.
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
  for node in nodes:
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
      outputs = call_layer(node.operation, args, kwargs, training)
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

  def forward(self, x, training=True, head=None, after=(), recompute=False):
    """(outputs, record), as `Stage.forward`; outputs are an environment."""
    env = self._environment(x)
    with tf.device(self.device), tf.name_scope(self.name + "/"):
      with tf.control_dependencies(after):
        inputs = {k: tf.identity(env[k]) for k in self.reads}
      if recompute:
        state = read_state(state_variables(self.layers))
        local = dict(inputs)
        self._run(local, training)
        outputs = self._outputs(env, local)
        target = self._target(local, outputs, head)
        return outputs, Record(None, inputs, target, state, head, training)
      with tf.GradientTape() as tape:
        tape.watch(inputs)
        local = dict(inputs)
        self._run(local, training)
        outputs = self._outputs(env, local)
        target = self._target(local, outputs, head)
    return outputs, Record(tape, inputs, target)

  def _recompute(self, record, grads_out):
    """The record `forward` would have kept, by running it again."""
    # Starts once the output gradient exists: in the backward pass.
    with tf.control_dependencies(tf.nest.flatten(grads_out)):
      inputs = {k: tf.identity(v) for k, v in record.inputs.items()}
    with restored_state(state_variables(self.layers), record.state):
      with tf.GradientTape() as tape:
        tape.watch(inputs)
        local = dict(inputs)
        self._run(local, record.training)
        outputs = local[self.outgoing[0]] if self.last else None
        target = self._target(local, outputs, record.head)
    return Record(tape, inputs, target)

  def activation_bytes(self, recompute=False):
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
