"""Pipeline parallelism: a model's layers cut into stages on S devices.

    layers:   [l_0 ... l_a-1 | l_a ... l_b-1 | ... ]    boundaries (a, b, ...)
    devices:     /CPU:0          /CPU:1        ...

Each stage's variables are created on its device (and so are their optimizer
slots: Keras creates slots colocated with their variable); `StagedTrainer`
runs the forward and backward pass of each stage on its device and streams M
micro-batches through the stages.
"""

import keras
import tensorflow as tf

from framework.errors import ConfigError, check_choice, check_positive
from framework.model_parallel.costs import BALANCES, layer_costs
from framework.model_parallel.devices import model_parallel_devices
from framework.model_parallel.boundaries import (balanced_boundaries,
                                                 check_boundaries)
from framework.model_parallel.graph import graph_stages, resolve_boundaries, split_graph
from framework.model_parallel.split_config import SplitConfig
from framework.settings import default
from framework.model_parallel.staged_trainer import StagedTrainer
from framework.model_parallel.stages import Stage


def model_layers(model):
  """The ordered layers of a `keras.Sequential` (its Input excluded)."""
  if not isinstance(model, keras.Sequential):
    raise ConfigError(
        f"pipeline parallelism needs a keras.Sequential model (an ordered "
        f"list of layers); got {type(model).__name__}")
  return list(model.layers)


def split_layers(layers, num_stages,
                 boundaries=default(SplitConfig, "stage_boundaries"),
                 balance=default(SplitConfig, "stage_balance")):
  """Cuts `layers` into `num_stages` lists (balanced by `balance`:
  forward + backward FLOPs or parameter count, see `costs`).

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
      FLOPs, see `costs`) or `params` (parameter count).
    recompute: keep only each stage's inputs per micro-batch and recompute
      its forward pass in backward (see `StagedTrainer`).
    serial_stages: each stage device runs its ops one at a time, in program
      order, as a GPU stream does (see `StagedTrainer`).
    devices: S device names; default `/GPU:0..` or `/CPU:0..`.
    replica_devices: data x pipeline: R lists of S devices (e.g. from
      `replicas.split_strategy`); copy r of the pipeline runs on list r
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
          clone = keras.models.clone_model(model)
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
