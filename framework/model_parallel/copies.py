"""Data x pipeline (x tensor): R copies of a split, one per group of devices.

    --strategy=mirrored --cpu_devices=4 --num_stages=2:
      devices   /CPU:0 /CPU:1 | /CPU:2 /CPU:3
      copy r=0  stage 0 stage 1                 (the model: checkpointed)
      copy r=1                   stage 0 stage 1 (kept equal to copy 0)

The data-parallel strategy only says which devices there are: its R*S
devices are cut into R groups of S consecutive devices (`split_strategy`,
`replica_groups`; a `--mesh` cuts them itself), copy r of the split runs on
group r with the r-th consecutive share of the global batch, and the run
itself uses one replica (the default strategy). Each stage's gradients are
summed across its R copies by TensorFlow's collective all-reduce
(`all_reduce_copies`: one CollectiveReduceV2 per copy, on its device, over
the data axis only) and every copy applies the same update, so the copies
stay equal. Copy 0 is the model that checkpoints, summaries and the weights
file see; the others follow it at the start of every `train`, where
fingerprints taken on each copy's own devices differ (after a restore, a
rollback, a user's `set_weights`: `PipelineCopies.sync_copies`). With
`shard_optimizer_state`, copy r keeps and updates 1/R of every optimizer
slot (`optimizer_sharding`, ZeRO-1 on the data axis); with `shard_gradients` too, each stage's gradients are
reduce-scattered over the copies instead (`reduce_scatter_copies`, ZeRO-2),
so copy r receives and accumulates only its slice. Under
`grad_accum_steps` each copy runs that many whole pipeline passes per step,
one after another.
"""

import keras
import tensorflow as tf

from framework import _tf_internal
from framework.core.optimizer_sharding import padded, shard_length
from framework.errors import ConfigError
from framework.model_parallel import fingerprints
from framework.model_parallel.devices import short_device, variable_device


SUM = tf.distribute.ReduceOp.SUM


def replica_groups(devices, num_stages, *, strategy_name="mirrored",
                   name="num_stages"):
  """`devices` (R*S of them) cut into R lists of S consecutive devices.

  Args:
    strategy_name: the strategy the devices are of, for messages.
    name: the argument S came from (`num_shards` for data x tensor).
  Raises:
    ConfigError: the device count is not a multiple of `num_stages`.
  """
  devices = [short_device(d) for d in devices]
  split = "pipeline" if name == "num_stages" else "tensor"
  if len(devices) % num_stages:
    raise ConfigError(
        f"strategy={strategy_name} has {len(devices)} devices, not a "
        f"multiple of {name}={num_stages}: data x {split} needs R * {name} "
        f"devices (e.g. --cpu_devices={2 * num_stages} for 2 copies)")
  return [devices[r:r + num_stages]
          for r in range(0, len(devices), num_stages)]


def split_strategy(strategy, num_stages, *, name="mirrored",
                   argument="num_stages"):
  """(one-replica strategy, R device groups) for a pipeline under `strategy`.

  A one-replica strategy is returned as it is, with no groups (None): the
  plain pipeline. A local multi-replica strategy (mirrored) gives its
  devices to `replica_groups`; the run then uses the default strategy.

  Raises:
    ConfigError: a cluster strategy, or a bad device count.
  """
  if strategy.num_replicas_in_sync == 1:
    return strategy, None
  if not isinstance(strategy, tf.distribute.MirroredStrategy):
    split = "pipeline" if argument == "num_stages" else "tensor"
    raise ConfigError(
        f"model_parallel={split} with strategy={name} is not supported; "
        f"use strategy=mirrored (R copies of the split on R * {argument} "
        "local devices) or strategy=default")
  groups = replica_groups(strategy.extended.worker_devices, num_stages,
                          strategy_name=name, name=argument)
  return tf.distribute.get_strategy(), groups


def _pack(tensors):
  return tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)


def _unpack(vector, like):
  sizes = [t.shape.num_elements() for t in like]  # variables' shapes
  return [tf.reshape(part, tf.shape(t))
          for part, t in zip(tf.split(vector, sizes), like)]


# TensorFlow's collective all-reduce as a cross-device op (what
# MultiWorkerMirroredStrategy uses; not exported under tf.distribute) and its
# keys, one set per process: each stage's group of devices gets its own
# group key, each all-reduce its own instance key.
_COLLECTIVE_KEYS = _tf_internal.collective_keys()
_COLLECTIVES = {}


def collective_all_reduce(devices):
  """TensorFlow's collective all-reduce over `devices` (one per group)."""
  key = tuple(devices)
  if key not in _COLLECTIVES:
    _COLLECTIVES[key] = _tf_internal.collective_all_reduce(
        devices, _COLLECTIVE_KEYS)
  return _COLLECTIVES[key]


def all_reduce_copies(per_copy, devices):
  """The sum over copies of one stage's gradients, on every copy's device.

  Args:
    per_copy: R lists of gradients (copy r's on `devices[r]`), same shapes.
    devices: the R devices of this stage's copies.
  Returns:
    R lists: the summed gradients, list r on `devices[r]` (equal values).
  """
  if len(per_copy) == 1:
    return [list(per_copy[0])]
  # One reduction per stage: each copy packs its gradients into a vector.
  vectors = []
  for grads, device in zip(per_copy, devices):
    with tf.device(device), tf.name_scope("pack_gradients/"):
      vectors.append(_pack(grads))
  # One CollectiveReduceV2 per copy, on its device, all in one group.
  # (Raw collective ops without the launcher's ordering tokens hang between
  # logical CPU devices of one process in TF 2.21; through
  # CollectiveAllReduce they complete.)
  summed = collective_all_reduce(devices).reduce(
      SUM, _tf_internal.per_replica(vectors),
      destinations=_tf_internal.per_replica(vectors))
  results = []
  for vector, device, grads in zip(summed.values, devices, per_copy):
    with tf.device(device), tf.name_scope("unpack_gradients/"):
      results.append(_unpack(vector, grads))
  return results


def reduce_scatter_copies(per_copy, devices, variables):
  """Copy r's slice of the sum over copies of one stage's gradients, on
  copy r's device (ZeRO-2 on the data axis).

  Each gradient is cut as ZeRO-1 cuts its variable (flattened, zero-padded
  to R * L elements, `optimizer_sharding.shard_of`). Copy q cuts its
  gradients on its own device and sends slice r to copy r, which sums the R
  slices it receives in copy order: each device sends and receives (R-1)/R
  of its gradient, a ring reduce-scatter's bytes, half an all-reduce's.
  All copies are in one graph (a cluster mesh's remote devices too), so
  these are plain device-to-device transfers: no collective group, and the
  same sum on every run.

  Args:
    per_copy: R lists of gradients (copy r's on `devices[r]`), same shapes.
    devices: the R devices of this stage's copies.
    variables: one copy's variables of these gradients (their shapes).
  Returns:
    R lists: list r holds copy r's [L] slice of each summed gradient, on
    `devices[r]`.
  """
  count = len(per_copy)
  lengths = [shard_length(v, count) for v in variables]
  pieces = []
  for grads, device in zip(per_copy, devices):
    with tf.device(device), tf.name_scope("scatter_gradients/"):
      # [R, sum of L]: row r is what copy r receives from this copy. An
      # embedding's IndexedSlices gradient converts to an unknown shape.
      rows = tf.concat(
          [tf.reshape(padded(tf.reshape(tf.convert_to_tensor(g), v.shape),
                             length, count), [count, length])
           for g, v, length in zip(grads, variables, lengths)], axis=1)
      pieces.append(tf.unstack(rows, count))  # cut here: 1/R goes out
  results = []
  for r, device in enumerate(devices):
    with tf.device(device), tf.name_scope("sum_gradient_slices/"):
      summed = tf.add_n([piece[r] for piece in pieces])
      results.append(tf.split(summed, lengths))
  return results


def sum_slices_copies(per_copy, devices):
  """Copy r's slice of the sum over copies of each gradient, where every
  copy's gradient comes cut into its R slices already (ZeRO-3 on the data
  axis: the gradients of the shards a stage joined its weights from).

  The sums `reduce_scatter_copies` makes (slice r from every copy, in copy
  order, on copy r's device) weight by weight, each as soon as the copies'
  slices of it exist: no gradient of a whole stage is packed first.

  Args:
    per_copy: R lists; element i of list q is copy q's gradient of weight
      i as R slices (a tuple; slice r on copy q's device).
    devices: R lists, the device of copy r's weight i (where its sum
      runs).
  Returns:
    R lists: list r holds copy r's [L] slice of each summed gradient.
  """
  count = len(per_copy)
  results = [[] for _ in range(count)]
  for i in range(len(per_copy[0])):
    for r in range(count):
      with tf.device(devices[r][i]), tf.name_scope("sum_gradient_slices/"):
        results[r].append(tf.add_n(
            [tf.convert_to_tensor(per_copy[q][i][r]) for q in range(count)]))
  return results


def _seed_states(model):
  """The states of `model`'s Keras seed generators: its variables that are
  not weights, of shape [2] ([seed, counter])."""
  weights = {id(w) for w in model.weights}
  return [v for v in model.variables
          if id(v) not in weights and _tf_internal.is_seed_generator_state(v)]


def tf_variable(variable):
  """The tf.Variable behind a Keras variable (a tf.Variable as it is)."""
  return variable.value if isinstance(variable, keras.Variable) else variable


class PipelineCopies:
  """The copies' half of `StagedTrainer` (a mixin: it reads the trainer's
  `stages`, `variables`, `optimizer` and `_pipeline_gradients`).

  Attributes:
    copies: `(stages, model, optimizer)` of copies 1..R-1 (empty: one copy).
  """

  def _set_up_copies(self, copies):
    """Builds the copies' optimizers, which share copy 0's step counter."""
    self.copies = copies
    self._copy_optimizers = {}
    self._sync_copies_fn = None
    for stages, model, optimizer in copies:
      variables = [v for s in stages for v in s.trainable_variables]
      if len(variables) != len(self.variables) or any(
          a.shape != b.shape for a, b in zip(variables, self.variables)):
        raise ValueError("a pipeline copy must have the stages' variables")
      if self.copy_sharding is not None:
        continue  # built on their shards, one step counter
      # One step counter: Adam's bias correction and any learning-rate
      # schedule see the same step in every copy.
      _tf_internal.share_step_counter(optimizer, self.optimizer.iterations)
      with self.strategy.scope():
        optimizer.build(model.trainable_variables)
      for v in variables:
        self._copy_optimizers[id(tf_variable(v))] = optimizer
    if self.copy_sharding is not None:
      self._copy_optimizers = self.copy_sharding.optimizer_of()

  def _copy_variables(self):
    """R lists: each copy's trainable variables, in stage order."""
    return [list(self.variables)] + [
        [v for s in stages for v in s.trainable_variables]
        for stages, _, _ in self.copies]

  def _copy_devices(self):
    """R lists: the device each copy's weights are trained on, weight by
    weight: its variable's, or with the state sharded its shard's (ZeRO-3
    keeps copy 0's whole variables on the host)."""
    sharding = getattr(self, "copy_sharding", None)
    return [[variable_device(v if sharding is None else sharding.shard(r, v))
             for v in vs]
            for r, vs in enumerate(self._copy_variables())]

  def _copies_train_step(self, features, labels):
    # ZeRO-2 on the data axis: each copy receives only its slices.
    scatter = self.copy_sharding is not None and self.updater.scatters()
    per_copy, loss, accuracy = self._copies_gradients(features, labels,
                                                      scatter=scatter)
    variables = [v for vs in self._copy_variables() for v in vs]
    if scatter:
      all_grads, grad_norm = self._clip_scattered(per_copy)
      self.updater.apply(all_grads, variables, scattered_norm=grad_norm)
      return {"loss": loss, "accuracy": accuracy,
              "grad_norm": self.replica_share(grad_norm)}
    # Every copy holds the same summed gradient: one norm, one clip.
    grads, grad_norm = self.clip_by_global_norm(per_copy[0])
    all_grads = list(grads)
    for copy_grads in per_copy[1:]:
      if self.clip_norm is not None:
        copy_grads, _ = tf.clip_by_global_norm(copy_grads, self.clip_norm,
                                               use_norm=grad_norm)
      all_grads.extend(copy_grads)
    if self.copy_sharding is not None:
      self._apply_copy_shards(all_grads, variables)
    else:
      # One optimizer step: each copy's variables updated on their device.
      self.apply_gradients(all_grads, variables)
    return {"loss": loss, "accuracy": accuracy,
            "grad_norm": self.replica_share(grad_norm)}

  def _clip_scattered(self, per_copy):
    """(every copy's slices, copy 0's first, clipped to `clip_norm`; the
    norm of the whole summed gradient): its square is the sum of the
    slices' squares over all copies (the padding adds zeros). Each slice's
    square sum and scaling stay on its device; only scalars move."""
    devices = self._copy_devices()
    squares = []
    for grads, copy_devices in zip(per_copy, devices):
      for grad, device in zip(grads, copy_devices):
        with tf.device(device):
          squares.append(tf.reduce_sum(tf.square(tf.cast(grad, tf.float32))))
    norm = tf.sqrt(tf.add_n(squares))
    flat = [g for grads in per_copy for g in grads]
    if self.clip_norm is None:
      return flat, norm
    # tf.clip_by_global_norm's factor, applied slice by slice.
    scale = self.clip_norm * tf.minimum(1.0 / norm, 1.0 / self.clip_norm)
    clipped = []
    for grads, copy_devices in zip(per_copy, devices):
      for grad, device in zip(grads, copy_devices):
        with tf.device(device):
          clipped.append(grad * tf.cast(scale, grad.dtype))
    return clipped, norm

  def _apply_copy_shards(self, grads, variables):
    """One step with the optimizer state sharded over the copies: the
    trainer's `updates.CopyShardedUpdate` (copy r updates slice r of each
    of its variables, then every copy's variables are joined from all
    copies' slices)."""
    return self.updater.apply(grads, variables)

  def _copy_pairs(self):
    """(copy 0's variable, copy r's variable): weights, optimizer slots."""
    # The slots. The step counter is shared and the learning rate copy 0's
    # (a copy's own are unused).
    own = _tf_internal.optimizer_slot_variables
    pairs = []
    for _, model, optimizer in self.copies:
      pairs += zip(self.model.weights, model.weights)
      if self.copy_sharding is None:  # sharded: each copy its own slice
        pairs += zip(own(self.optimizer), own(optimizer))
    if getattr(self, "parameter_sharding", None) is not None:
      # ZeRO-3: the step reads copy r's shards, not its trainable variables.
      trained = {id(tf_variable(v)) for _, model, _ in self.copies
                 for v in model.trainable_variables}
      pairs = [(a, b) for a, b in pairs if id(tf_variable(b)) not in trained]
    pairs = [(a, b) for a, b in pairs
             if tf_variable(a).shape.num_elements() != 0]  # nothing to set
    for a, b in pairs:
      if a.shape != b.shape:
        raise ValueError(f"pipeline copy mismatch: {a.path} {a.shape}, "
                         f"{b.path} {b.shape}")
    return pairs

  def sync_copies(self):
    """Sets every copy's weights and optimizer slots to copy 0's where they
    differ; returns the bytes it assigned (an int64 scalar tensor).

    Copy 0 is what checkpoints save and restore (and what the weights file
    holds, and what a warm start, a rollback or a user's `set_weights`
    changes); the copies follow it at the start of every `train`. Equal
    copies stay equal: they apply the same update every step, so in an
    uninterrupted run nothing moves. Each copy fingerprints its own
    variables on its own devices (`fingerprints`); only the [2]-vectors
    and a flag per variable cross devices, and a variable is assigned
    from copy 0 only where its fingerprint differs. With the state sharded
    over the copies only the weights: each copy's slots are its own slice,
    which a restore sets directly (`optimizer_sharding`); with the weights
    sharded too, only the weights the step reads (the layers' state: the
    other copies' trainable variables are not read, their shards are).
    """
    if self._sync_copies_fn is None:
      pairs = self._copy_pairs()
      seeds = self._seed_pairs()

      def sync():
        moved = [tf.zeros([], tf.int64)]
        sources = {}  # copy 0's fingerprints, once for all copies
        for source, target in pairs:
          source, target = tf_variable(source), tf_variable(target)
          if id(source) not in sources:
            with tf.device(variable_device(source)):
              sources[id(source)] = fingerprints.fingerprint(source)
          with tf.device(variable_device(target)):
            changed = fingerprints.differs(sources[id(source)],
                                           fingerprints.fingerprint(target))
          moved.append(_assign_if(changed, target,
                                  lambda s=source: tf.convert_to_tensor(s)))
        for source, target in seeds:
          # Only the draw counter follows copy 0's (each copy its own seed).
          source, target = tf_variable(source), tf_variable(target)
          with tf.device(variable_device(target)):
            counter = source[1]
            changed = tf.not_equal(counter, target[1])
            moved.append(_assign_if(
                changed, target,
                lambda t=target, c=counter: tf.stack([t[0], c])))
        return tf.add_n(moved)

      # Explicit conds: nothing for AutoGraph to convert.
      self._sync_copies_fn = tf.function(sync, autograph=False)
    return self._sync_copies_fn()

  def _seed_pairs(self):
    """(copy 0's, copy r's) Keras seed generator states ([seed, counter]:
    Dropout's and other random layers'). Copy 0's are checkpointed, copy
    r's are not: `sync_copies` sets copy r's counter to copy 0's (they
    draw in step, so this changes nothing in a run) and keeps its own seed
    (its own masks), so that a resumed run draws what an uninterrupted one
    would."""
    pairs = []
    for _, model, _ in self.copies:
      source, target = _seed_states(self.model), _seed_states(model)
      if len(source) != len(target):
        raise ValueError("pipeline copy mismatch: "
                         f"{len(source)} seed generators, {len(target)}")
      pairs += zip(source, target)
    return pairs

  def _copies_gradients(self, features, labels, scatter=False):
    """(R lists of gradients, loss, accuracy): every copy's gradients,
    summed over the copies.

    Copy r runs the pipeline on the r-th consecutive share of the batch
    (under `grad_accum_steps` K, on K consecutive parts of it, one after
    another, each a whole pipeline pass); its micro-batch losses are still
    divided by the GLOBAL batch size, so the sum over copies of a stage's
    gradients is the full-batch gradient. Without `scatter` each copy
    accumulates its gradients whole and they are all-reduced once; with it
    (ZeRO-2) each accumulation step's are reduce-scattered at once
    (`reduce_scatter_copies`) and list r holds copy r's [L] slices only.
    """
    all_stages = [self.stages] + [stages for stages, _, _ in self.copies]
    steps = self.grad_accum_steps
    parts = [list(zip(tf.split(x, steps), tf.split(y, steps))) if steps > 1
             else [(x, y)]
             for x, y in zip(tf.split(features, len(all_stages)),
                             tf.split(labels, len(all_stages)))]
    devices = self._copy_devices()
    totals = [None] * len(all_stages)
    losses, accuracies = [], []
    for step in range(steps):
      per_copy = []
      for r, stages in enumerate(all_stages):
        x, y = parts[r][step]
        if totals[r] is not None:
          # One accumulation step at a time: its activations, then the next.
          with tf.control_dependencies(
              tf.nest.flatten(totals[r], expand_composites=True)):
            x = tf.identity(x)
        grads, loss, accuracy = self._pipeline_gradients(stages, x, y)
        per_copy.append([g for stage_grads in grads for g in stage_grads])
        losses.append(loss)
        accuracies.append(accuracy)
      if scatter:
        per_copy = self._reduce_copies(per_copy, scatter=True)
      for r, grads in enumerate(per_copy):
        totals[r] = (grads if totals[r] is None
                     else _add_on_devices(totals[r], grads, devices[r]))
    if not scatter:
      totals = self._reduce_copies(totals)
    with tf.device(self.stages[-1].device):
      return totals, tf.add_n(losses), tf.add_n(accuracies)

  def _copy_groups(self):
    """[(indices into a copy's variables, the R copies' device)]: the
    gradients reduced together over the copies, one group per stage (a
    tensor split overrides this: one per device position)."""
    groups, start = [], 0
    all_stages = [self.stages] + [stages for stages, _, _ in self.copies]
    for i, stage_variables in enumerate(self.stage_variables):
      groups.append((list(range(start, start + len(stage_variables))),
                     [stages[i].device for stages in all_stages]))
      start += len(stage_variables)
    return groups

  def _reduce_copies(self, per_copy, scatter=False):
    """R lists of gradients summed over the copies, group by group
    (`_copy_groups`): whole on every copy (`all_reduce_copies`), or with
    `scatter` copy r's slice only (`reduce_scatter_copies`; ZeRO-3's
    gradients come cut already: `sum_slices_copies`)."""
    if scatter and any(isinstance(g, tuple) for g in per_copy[0]):
      return sum_slices_copies(per_copy, self._copy_devices())
    variables = self.variables
    reduced = [list(grads) for grads in per_copy]
    for indices, devices in _by_dtype(self._copy_groups(), variables):
      group = [[grads[i] for i in indices] for grads in per_copy]
      summed = (reduce_scatter_copies(group, devices,
                                      [variables[i] for i in indices])
                if scatter else all_reduce_copies(group, devices))
      for r, grads in enumerate(summed):
        for i, grad in zip(indices, grads):
          reduced[r][i] = grad
    return reduced


def _assign_if(changed, target, value):
  """`target.assign(value())` when `changed` (a bool scalar); its bytes if
  it ran, else 0. `value` reads copy 0 inside the branch: a branch not
  taken reads and sends nothing."""
  nbytes = (tf.TensorShape(target.shape).num_elements()
            * tf.as_dtype(target.dtype).size)

  def assign():
    with tf.control_dependencies([target.assign(value())]):
      return tf.constant(nbytes, tf.int64)

  return tf.cond(changed, assign, lambda: tf.constant(0, tf.int64))


def _by_dtype(groups, variables):
  """`groups` split by variable dtype, empty ones dropped: one reduction
  packs its gradients into one vector (a stage may mix float16, float32 and
  float64 layers, or train no variable at all)."""
  for indices, devices in groups:
    dtypes = {}
    for i in indices:
      dtypes.setdefault(variables[i].dtype, []).append(i)
    for same in dtypes.values():
      yield same, devices


def _add_on_devices(totals, grads, devices):
  """totals + grads, each sum on its weight's device."""
  summed = []
  for total, grad, device in zip(totals, grads, devices):
    with tf.device(device), tf.name_scope("accumulate/"):
      summed.append(tf.convert_to_tensor(total) + tf.convert_to_tensor(grad))
  return summed
