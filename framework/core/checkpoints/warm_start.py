"""Warm start: a new run's model weights from another run or a weights file.

    init_checkpoint=PATH   a distloop run folder (its newest intact
                           checkpoint), any folder holding a TF checkpoint
                           (e.g. a run's best/), a TF checkpoint prefix, or
                           a Keras .weights.h5 file

Only the model's weights are read: the optimizer's slots, the step, the data
position and the EMA start fresh (the EMA from the restored weights). It
happens only when the run's own model_dir has no checkpoint: a relaunch
resumes from its own checkpoint and never re-initialises.

A variable matches by name and shape: in a TF checkpoint its object path
under `model/` (what `tf.train.Checkpoint(model=...)` writes, the layers in
build order), in a .weights.h5 file its Keras path (`layers/<class>_<n>/vars/
<i>`). `skip_mismatch` keeps the model's own values where the source has no
such variable or another shape (a new classification head) and names them;
without it any such variable is an error. `exclude` (a regular expression
searched in the Keras variable path, e.g. `dense_1/`, or in a .weights.h5
name) keeps those variables' fresh values.
"""

import os
import re
import tempfile

from absl import logging
import keras
import tensorflow as tf

from framework import _tf_internal
from framework.core import adapt, protocols
from framework.core.checkpoints import manager
from framework.errors import CheckpointError, ConfigError, first_line


WEIGHTS_FILE_SUFFIX = ".weights.h5"
# The root object under which `Controller` (and most users) save the model.
_MODEL_ROOT = "model"


def check_exclude(exclude):
  """`exclude` compiled (None stays None); ConfigError naming it if bad."""
  if exclude in (None, ""):
    return None
  try:
    return re.compile(exclude)
  except re.error as e:
    raise ConfigError(f"init_exclude={exclude!r} is not a regular "
                      f"expression ({e})") from None


def resolve(path):
  """("checkpoint", prefix) or ("h5", file) that `path` names.

  Raises CheckpointError (one line naming `path`) when it is missing, holds
  neither kind or is damaged.
  """
  where = f"init_checkpoint={path}"
  if tf.io.gfile.isdir(path):
    if tf.io.gfile.exists(os.path.join(path, "checkpoint")):
      try:
        prefix, _ = manager.latest_intact(path)
      except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
      if prefix is not None:
        return "checkpoint", prefix
    indexes = tf.io.gfile.glob(os.path.join(path, "*.index"))
    if indexes:
      # Without a state file: the newest by number (ckpt-10 after ckpt-9).
      def number(name):
        found = re.findall(r"\d+", os.path.basename(name))
        return (int(found[-1]) if found else -1, name)
      return _checked_prefix(where, max(indexes, key=number)[:-len(".index")])
    weights = sorted(tf.io.gfile.glob(os.path.join(path,
                                                   "*" + WEIGHTS_FILE_SUFFIX)))
    if weights:
      # A run whose checkpoints were removed: its final model.weights.h5.
      return "h5", weights[0]
    raise CheckpointError(
        f"{where} is a folder without a TF checkpoint (no 'checkpoint' state "
        f"file, no *.index) and without a *{WEIGHTS_FILE_SUFFIX} file; name "
        "a run folder, a checkpoint prefix or a Keras weights file")
  if path.endswith(".h5"):
    if not tf.io.gfile.exists(path):
      raise CheckpointError(f"{where} does not exist")
    return "h5", path
  if tf.io.gfile.exists(path + ".index"):
    return _checked_prefix(where, path)
  if path.endswith(".index") and tf.io.gfile.exists(path):
    return _checked_prefix(where, path[:-len(".index")])
  raise CheckpointError(
      f"{where} does not exist (neither a folder, a .weights.h5 file nor a "
      "checkpoint prefix with a .index file)")


def _checked_prefix(where, prefix):
  problem = manager.damage(prefix)
  if problem is not None:
    raise CheckpointError(f"{where}: checkpoint {prefix} is damaged: "
                          f"{problem}")
  return "checkpoint", prefix


def _escape(name):
  # TensorFlow's checkpoint keys escape "." and "/" inside one object's name
  # (trackable_utils.escape_local_name).
  return name.replace(".", "..").replace("/", ".S")


def _model_variables(model):
  """[(object path under the model, variable)] in tracking order."""
  view = tf.train.TrackableView(model)
  found, seen = [], {id(model)}

  def walk(obj, path):
    for name, child in view.children(obj).items():
      if id(child) in seen:
        continue
      seen.add(id(child))
      if isinstance(child, (tf.Variable, keras.Variable)) or _whole(child):
        found.append(("/".join(path + [_escape(name)]), child))
      else:
        walk(child, path + [_escape(name)])

  walk(model, [])
  return found


def _whole(obj):
  """A split's weight cut over devices, saved and assigned whole
  (`model_parallel.parallel_layers.ShardedWeight`: core cannot import it)."""
  return (hasattr(obj, "shards") and hasattr(obj, "assign")
          and hasattr(obj, "shape") and hasattr(obj, "dtype"))


def _name(variable):
  return getattr(variable, "path", None) or variable.name.split(":")[0]


def _plan(targets, source_shapes, exclude):
  """(restore [(target, key, name)], skipped [(name, why)], excluded)."""
  restore, skipped, excluded = [], [], []
  for key, variable, name in targets:
    if exclude is not None and exclude.search(name):
      excluded.append(name)
      continue
    shape = source_shapes.get(key)
    if shape is None:
      skipped.append((name, "not in the source"))
    elif list(shape) != list(variable.shape):
      skipped.append((name, f"shape {list(shape)} in the source, "
                            f"{list(variable.shape)} here"))
    else:
      restore.append((variable, key, name))
  return restore, skipped, excluded


def _checkpoint_keys(reader):
  """{object path: checkpoint key} of every variable value in the checkpoint,
  under every path that reaches it (a checkpoint names each value once,
  after its first path, often the optimizer's list of variables)."""
  graph = _tf_internal.checkpoint_object_graph(reader)
  keys = {}

  def walk(node_id, path, on_path):
    node = graph.nodes[node_id]
    for attribute in node.attributes:
      if attribute.name == _tf_internal.VARIABLE_VALUE_KEY and path:
        keys.setdefault("/".join(path), attribute.checkpoint_key)
    for child in node.children:
      if child.node_id not in on_path:
        walk(child.node_id, path + [_escape(child.local_name)],
             on_path | {child.node_id})

  walk(0, [], {0})
  return keys


def _checkpoint_plan(model, prefix, exclude):
  reader = tf.train.load_checkpoint(prefix)
  shapes = reader.get_variable_to_shape_map()
  by_path = _checkpoint_keys(reader)
  variables = _model_variables(model)

  def targets(root):
    return [(by_path.get(f"{root}/{path}"), variable, _name(variable))
            for path, variable in variables]

  # The model under `model/` (Controller's checkpoints); else under the root
  # object whose variables match best (another script's checkpoint).
  roots = {path.split("/", 1)[0] for path in by_path if "/" in path}
  roots = [_MODEL_ROOT] + sorted(roots - {_MODEL_ROOT})
  best = max(roots, key=lambda root: sum(key in shapes for key, _, _ in
                                         targets(root)))
  return _plan(targets(best), shapes, exclude), reader.get_tensor


def _h5_restore(model, path, exclude, skip_mismatch, where):
  """Restores from a Keras .weights.h5 through a merged copy (Keras's own
  loader then puts every value where it belongs)."""
  import h5py  # pylint: disable=g-import-not-at-top  (Keras's dependency)
  try:
    source = h5py.File(path, "r")
  except OSError as e:
    raise CheckpointError(f"{where}: {path} cannot be read as a Keras "
                          f"weights file ({first_line(e)})") from None
  with source, tempfile.TemporaryDirectory() as tmp:
    merged = os.path.join(tmp, "merged" + WEIGHTS_FILE_SUFFIX)
    model.save_weights(merged)
    with h5py.File(merged, "r+") as target:
      names = []
      target.visititems(lambda name, item: names.append(name) if isinstance(
          item, h5py.Dataset) else None)
      shapes = {}
      source.visititems(lambda name, item: shapes.__setitem__(
          name, item.shape) if isinstance(item, h5py.Dataset) else None)
      targets = [(name, target[name], name) for name in names]
      restore, skipped, excluded = _plan(targets, shapes, exclude)
      _check(where, restore, skipped, skip_mismatch, len(names))
      try:
        for dataset, name, _ in restore:
          dataset[...] = source[name][...]
      except OSError as e:
        raise CheckpointError(f"{where}: {path} is damaged "
                              f"({first_line(e)})") from None
    model.load_weights(merged)
  return [name for _, _, name in restore], skipped, excluded


def _check(where, restore, skipped, skip_mismatch, total):
  if skipped and not skip_mismatch:
    name, why = skipped[0]
    raise CheckpointError(
        f"{where}: {len(skipped)} of the model's variables do not match, "
        f"e.g. {name} ({why}); pass init_skip_mismatch to keep their fresh "
        "values (a new head), or init_exclude=REGEX")
  if not restore:
    raise CheckpointError(
        f"{where} matches none of the model's {total} variables (by name and "
        "shape); is it a checkpoint of this model?")


def restore_weights(model, path, *, skip_mismatch=False, exclude=None):
  """Puts `path`'s matching weights into `model`; returns what it did.

  Returns:
    {"path", "source" (the resolved checkpoint or file), "restored" (count),
    "skipped" [name, ...], "excluded" [name, ...]}.
  Raises:
    CheckpointError: `path` missing or damaged, a mismatch without
      `skip_mismatch`, or nothing matched.
  """
  where = f"init_checkpoint={path}"
  pattern = check_exclude(exclude)
  kind, source = resolve(path)
  if kind == "h5":
    restored, skipped, excluded = _h5_restore(model, source, pattern,
                                              skip_mismatch, where)
  else:
    try:
      (restore, skipped, excluded), read = _checkpoint_plan(model, source,
                                                            pattern)
    except tf.errors.OpError as e:
      raise CheckpointError(f"{where}: {source} cannot be read "
                            f"({first_line(e)})") from None
    _check(where, restore, skipped, skip_mismatch,
           len(restore) + len(skipped) + len(excluded))
    values = []
    try:
      values = [read(key) for _, key, _ in restore]
    except tf.errors.OpError as e:
      raise CheckpointError(f"{where}: {source} is damaged "
                            f"({first_line(e)})") from None
    for (variable, _, _), value in zip(restore, values):
      variable.assign(tf.cast(value, variable.dtype))
    restored = [name for _, _, name in restore]
  adapt.refresh(model)  # adapted preprocessing layers read what came in
  for name, why in skipped:
    logging.warning("init_checkpoint: skipped %s (%s): it keeps its fresh "
                    "value", name, why)
  if excluded:
    logging.info("init_checkpoint: excluded %s", ", ".join(excluded))
  logging.info("Warm start: %d variables from %s (%d skipped, %d excluded); "
               "optimizer, step and data position start fresh",
               len(restored), source, len(skipped), len(excluded))
  return {"path": path, "source": source, "restored": len(restored),
          "skipped": [name for name, _ in skipped], "excluded": excluded}


def warm_start(controller, path, *, skip_mismatch=False, exclude=None):
  """`restore_weights` into the controller's model if it restored no
  checkpoint of its own; the record for model_info.json, or None.

  Call after `controller.restore()`. With an EMA, the averages restart
  from the restored weights.
  """
  if not path:
    return None
  if controller.restored_from is not None:
    logging.info("init_checkpoint=%s not used: resuming from this run's own "
                 "checkpoint %s", path, controller.restored_from)
    return None
  trainer = controller.trainer
  record = restore_weights(trainer.model, path, skip_mismatch=skip_mismatch,
                           exclude=exclude)
  ema = protocols.optional(trainer, "ema")
  if ema is not None:
    for average, variable in zip(ema.averages, ema.variables):
      ema.strategy.extended.update(
          average, lambda a, v: a.assign(tf.cast(v, a.dtype)), args=(variable,))
  return record
