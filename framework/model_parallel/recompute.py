"""Activation recomputation without a split (`--recompute=blocks|attention|every:K`).

A recomputed segment keeps only its inputs for the backward pass; the
backward pass runs the segment's forward again (TensorFlow's
`tf.recompute_grad`) and takes its gradient from that. Less activation
memory, one more forward pass of the segment per step. The segments:

* `blocks`: each layer that declares itself a block (the GPT's
  transformer blocks), split or not;
* `attention`: each layer that declares itself attention (the GPT's
  causal self-attention sublayer), split or not;
* `every:K`: each run of K consecutive top-level layers of a functional
  model (in the order Keras runs them; the last run may be shorter).

A layer declares itself with `segment(self, unit, fn, *args)` in its call;
whether it recomputes is fixed when it is made, under `policy(value)`
(as Keras's own `RematScope`): the run's model and its split are made
under the run's `--recompute`.

The recomputed forward pass sees the layers' state as it was before the
original pass (the same dropout masks from the same seed counters) and
leaves no trace in it (BatchNorm statistics updated once): the staged
trainer's `restored_state`. Weights, checkpoints and the numbers are
those of the run without recomputation.
"""

import contextlib
import threading

import keras
import tensorflow as tf

from framework.errors import ConfigError
from framework.model_parallel.config import parse_recompute
from framework.model_parallel.staged_trainer import read_state, state_variables

_scope = threading.local()


@contextlib.contextmanager
def policy(value):
  """Layers made inside declare segments recomputed as `value` says (a
  `--recompute` value); yields the set of units they declared."""
  previous = getattr(_scope, "policy", None)
  _scope.policy = (parse_recompute(value), set())
  try:
    yield _scope.policy[1]
  finally:
    _scope.policy = previous


def wants(unit):
  """Whether a layer of `unit` (`block`, `attention`) made now recomputes."""
  current = getattr(_scope, "policy", None)
  if current is None:
    return False
  current[1].add(unit)
  return current[0] == {"block": "blocks"}.get(unit, unit)


def recomputed(fn, layers):
  """`fn(*tensors) -> tensors`, recomputed in the backward pass.

  Floating tensors are the segment's differentiable inputs; the others
  (token ids) are captured. `layers`: whose state the recomputation
  replays and then puts back.
  """
  variables = state_variables(layers)

  def run(*args):
    floating = [i for i, a in enumerate(args)
                if tf.is_tensor(a) and a.dtype.is_floating]
    before = read_state(variables)
    calls = []

    def body(*xs):
      full = list(args)
      for i, x in zip(floating, xs):
        full[i] = x
      if not calls:  # the forward pass
        calls.append(True)
        return fn(*full)
      # The recomputation: every op of it after the state is put back as
      # it was before the forward pass, and the state left as the forward
      # pass left it (explicit dependencies: the gradient's ops are not
      # ordered by the function's automatic ones).
      after = read_state(variables)
      with tf.control_dependencies(after):
        restored = [v.assign(b) for v, b in zip(variables, before)]
      with tf.control_dependencies(restored):
        outputs = fn(*[tf.identity(x) if tf.is_tensor(x) else x
                       for x in full])
        # Whatever it read or wrote of the state, once it is done.
        done = read_state(variables) + tf.nest.flatten(outputs)
      with tf.control_dependencies(done):
        back = [v.assign(a) for v, a in zip(variables, after)]
      with tf.control_dependencies(back):
        return tf.nest.map_structure(tf.identity, outputs)

    return tf.recompute_grad(body)(*[args[i] for i in floating])

  return run


def segment(layer, unit, fn, *args):
  """`fn(*args)`, recomputed if `layer` (made under `policy`) wants it."""
  if getattr(layer, "recompute_segment", False):
    return recomputed(fn, [layer])(*args)
  return fn(*args)


def recompute_graph(model, every, wrap=recomputed, purpose=None):
  """Makes the functional `model` run its top-level layers in runs of
  `every`, each recomputed. The model object, its layers and variables
  stay the same (checkpoints unchanged).

  `wrap(run, layers)`: what each run of layers becomes (`recomputed`; ZeRO-3
  wraps its weight gathering around it); `purpose`: the setting named in
  errors (`recompute=every:K`).

  Raises:
    ConfigError: not a functional model of one input and one output.
  """
  # A function-level import: pipeline loads the flops counter.
  from framework.model_parallel import pipeline  # pylint: disable=g-import-not-at-top
  if isinstance(model, keras.Sequential):
    # A chain: runs of K layers, each one's output the next one's input.
    chains = [model.layers[i:i + every]
              for i in range(0, len(model.layers), every)]

    def run_chains(inputs, training=None, mask=None):
      del mask  # as the functional call below
      x = tf.nest.flatten(inputs)[0]
      for chain in chains:

        def run(x, chain=chain):
          for layer in chain:
            x = pipeline.call_layer(layer, (x,), {}, training)
          return x

        x = wrap(run, chain)(x)
      return x

    model.call = run_chains
    return model
  purpose = purpose or f"recompute=every:{every}"
  if not pipeline.is_functional(model):
    raise ConfigError(
        f"{purpose} runs a functional keras.Model's top-level "
        f"layers in runs of {every}; {type(model).__name__} {model.name!r} "
        "has no layer graph (use a functional or Sequential model)")
  if len(model.inputs) != 1 or len(model.outputs) != 1:
    raise ConfigError(
        f"{purpose} needs a model with one input and one "
        f"output; {model.name} has {len(model.inputs)} and "
        f"{len(model.outputs)}")
  nodes = pipeline.graph_nodes(model, once=False)
  groups = [nodes[i:i + every] for i in range(0, len(nodes), every)]
  input_key, output_key = id(model.inputs[0]), id(model.outputs[0])
  plan = []
  for i, group in enumerate(groups):
    made = {id(t) for n in group for t in n.outputs}
    reads = []
    for n in group:
      for t in n.input_tensors:
        if id(t) not in made and id(t) not in reads:
          reads.append(id(t))
    later = {id(t) for g in groups[i + 1:] for n in g for t in n.input_tensors}
    later.add(output_key)
    makes = [id(t) for n in group for t in n.outputs if id(t) in later]
    plan.append((group, reads, makes))

  def call(inputs, training=None, mask=None):
    del mask  # one input: Keras's own masks are not carried
    env = {input_key: tf.nest.flatten(inputs)[0]}
    for group, reads, makes in plan:

      def run(*tensors, group=group, reads=reads, makes=makes):
        local = dict(zip(reads, tensors))
        for node in group:
          args, kwargs = node.arguments.fill_in(local)
          outputs = pipeline.call_layer(node.operation, args, kwargs,
                                        training)
          for key, value in zip(node.outputs, tf.nest.flatten(outputs)):
            local[id(key)] = value
        return [local[k] for k in makes]

      layers = [n.operation for n in group]
      outputs = wrap(run, layers)(*[env[k] for k in reads])
      env.update(zip(makes, outputs))
    return env[output_key]

  model.call = call
  return model


def apply(model, value, declared):
  """Recomputes `model` (unsplit, made under `policy(value)`) as `value`.

  Args:
    declared: the units its layers declared (what `policy` yielded).
  Raises:
    ConfigError: `blocks` or `attention` on a model without such layers,
      `every:K` on a model without a layer graph.
  """
  value = parse_recompute(value)
  if value in (False, True):
    return model
  if value.startswith("every:"):
    return recompute_graph(model, int(value.split(":")[1]))
  unit = {"blocks": "block"}.get(value, value)
  if unit not in declared:
    raise ConfigError(
        f"recompute={value}: model {model.name!r} has no layer that "
        f"declares itself {'a block' if unit == 'block' else unit} (the "
        "GPT's transformer blocks and attention do); use "
        "--recompute=every:K to recompute runs of K top-level layers")
  return model
