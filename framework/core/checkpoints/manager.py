"""Checkpoints that resume exactly and are safe with several workers.

Every worker must take part in a multi-worker save (the save is a collective);
only the chief's copy is kept, the others write to a temporary directory that
is removed straight after. A checkpoint that cannot be restored is an error,
never a silent restart from scratch.

Before restoring, the newest checkpoint is read in full
(`latest_intact`, below). A damaged one is named in a warning and the newest
intact one is restored instead (`restore_policy="latest_intact"`), or it is
an error (`"error"`). The chief also keeps `run_config.json` beside the
checkpoints (model, options, optimizer, global batch, dataset), so that
resuming with another configuration is an error unless allowed
(`run_config.compare`). Whether a run may continue from a folder, and what
its run_config holds, is decided in `framework.app.resume`; this module
writes, finds and restores.
"""

import json
import os
import re
import shutil
import threading
import uuid
from typing import Any, Mapping, Optional

from absl import logging
from google.protobuf import text_format
import keras
import tensorflow as tf

from framework import _tf_internal
from framework.core import protocols
from framework.core.checkpoints import run_config as run_config_lib
from framework.core.checkpoints import run_files
from framework.core.checkpoints import sharding as sharding_lib
from framework.core.config import RESTORE_POLICIES, LoopConfig
from framework.distribute import cluster, strategies
from framework.settings import default
from framework.errors import (CheckpointError, ConfigError, ModelDirError,
                              check_choice, check_positive, first_line)


_WORKER_TMP = ".tmp_worker_"
RUN_CONFIG_FILE = "run_config.json"
# The temporary names TensorFlow's savers use while writing `ckpt-<N>`
# (functional_saver: "<prefix>_temp/part", older savers "<prefix>_temp_<uuid
# hex>"; the bundle writer's "<file>.tempstate<random>") and distloop's own
# worker directories. Nothing else in model_dir is ever removed.
_ORPHAN_NAMES = re.compile(
    r"ckpt-\d+_temp(_[0-9a-f]{32})?"
    r"|ckpt-\d+\.(index|data-\d{5}-of-\d{5})\.tempstate\d+"
    r"|" + re.escape(_WORKER_TMP) + r".+"
    r"|" + run_files.ORPHAN_NAMES.pattern)


def _save_reason(error):
  """The OS's words in a saver's error, without TensorFlow's function
  and op names ("{{function_node __wrapped__SaveV2...}} <file>; No space
  left on device [Op:SaveV2]" -> "No space left on device")."""
  text = re.sub(r"\{\{[^}]*\}\}\s*", "", first_line(error))
  text = re.sub(r"\s*\[Op:\w+\]\s*$", "", text)
  return text.rsplit("; ", 1)[-1].strip() or type(error).__name__


def _megabytes(count):
  return (f"{count / 1e9:.1f} GB" if count >= 1e9 else
          f"{count / 1e6:.1f} MB")


def _free_bytes(directory):
  """Free bytes on `directory`'s filesystem (None for a URL or an error)."""
  if "://" in directory:
    return None
  try:
    return shutil.disk_usage(directory).free
  except OSError:
    return None


class CheckpointManager:
  """Saves and restores `checkpoint` in `model_dir` (chief) or a temp dir.

  Args:
    checkpoint: a `tf.train.Checkpoint` (model, optimizer, global step, ...).
    model_dir: where the chief's `ckpt-<step>` files live.
    strategy: decides chief versus other workers.
    max_to_keep: how many of the newest checkpoints to keep.
    restore_policy: "latest_intact" (a damaged newest checkpoint is named
      in a warning and the newest intact one restored) or "error".
    run_config: a JSON-able dict of what must not change between a
      checkpoint and the run resuming from it (see `export.run_config`);
      None: not checked.
    allow_config_change: a changed `run_config` is a warning, not an error
      (None: not given, an error as without --allow_config_change; the
      setting's default lives in ExperimentConfig, above this layer).
    async_checkpoint: write in the background (`save` returns once the
      variables are copied; `wait` waits for the write). One process only:
      ConfigError, before anything is written, for a strategy with
      several workers or parameter servers.
    sharding: `gathered` or `by_task`: who writes the tensors of a model
      split across processes (`framework.core.checkpoints.sharding`).
  """

  def __init__(self, checkpoint, model_dir, strategy, *, max_to_keep=3,
               restore_policy="latest_intact", run_config=None,
               allow_config_change=None,
               async_checkpoint=default(LoopConfig, "async_checkpoint"),
               sharding=default(LoopConfig, "checkpoint_sharding")):
    check_positive("keep_checkpoints", max_to_keep)
    self.sharding = sharding
    self._options = sharding_lib.options(sharding)
    self.async_checkpoint = bool(async_checkpoint)
    if self.async_checkpoint:
      check_async(strategy)
    # (step, thread) of the write in flight (async_checkpoint), its error,
    # and the in-memory manager that serializes a save.
    self._pending = None
    self._write_error = None
    self._staging = None
    self.checkpoint = checkpoint
    # Resolved once: TensorFlow's state file and this class join paths onto
    # the directory, and a relative one would be joined twice.
    model_dir = absolute(model_dir)
    self.model_dir = model_dir
    self.is_chief = strategies.is_chief(strategy)
    self.restore_policy = check_choice("restore_policy", restore_policy,
                                       RESTORE_POLICIES)
    self.run_config = run_config
    self.allow_config_change = bool(allow_config_change)
    # [(key, old, new)] an allowed resume changed (see _check_run_config).
    self.config_changes = []
    if self.is_chief:
      self.directory = model_dir
    else:
      task_type, task_id = strategies.task_info(strategy)
      self.directory = os.path.join(model_dir,
                                    f"{_WORKER_TMP}{task_type}_{task_id}")
    tf.io.gfile.makedirs(self.directory)
    if self.is_chief:
      self.clean_orphans()
    self._check_state_file()
    self._max_to_keep = max_to_keep
    self.manager = self._new_manager()

  def _new_manager(self):
    return tf.train.CheckpointManager(
        self.checkpoint, self.directory, max_to_keep=self._max_to_keep,
        checkpoint_name="ckpt")

  def clean_orphans(self):
    """Removes what a killed save left: only TensorFlow's temporary
    checkpoint names and distloop's worker directories (user files stay)."""
    for name in sorted(tf.io.gfile.listdir(self.model_dir)):
      name = name.rstrip("/")
      if not _ORPHAN_NAMES.fullmatch(name):
        continue
      path = os.path.join(self.model_dir, name)
      logging.info("Removing orphaned temporary checkpoint data %s", path)
      if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        os.remove(path)

  def _check_state_file(self):
    if not self.is_chief:
      return
    # Garbled: rewritten from the ckpt-* files before TensorFlow reads it
    # (it would log a ParseError and see no checkpoint at all).
    rebuild(self.directory)
    has_data = tf.io.gfile.glob(os.path.join(self.directory, "ckpt-*.index"))
    try:
      state = tf.train.get_checkpoint_state(self.directory)
    except Exception as e:  # a corrupt text proto raises a parse error
      raise CheckpointError(
          f"the checkpoint state file {self.directory}/checkpoint is corrupt "
          f"({first_line(e)}); ckpt-* files exist, so refusing to start from "
          "scratch: fix or delete the state file") from None
    if has_data and (state is None or not state.model_checkpoint_path):
      raise CheckpointError(
          f"{self.directory} holds ckpt-* files but its 'checkpoint' state "
          "file is missing or empty; refusing to start from scratch: restore "
          "the state file or move the ckpt-* files away")

  @property
  def latest(self):
    return self.manager.latest_checkpoint if self.is_chief else None

  def restore_latest(self, path=None):
    """Restores `path` (default: the newest intact); returns it or None.

    Nothing is written unless a damaged newer checkpoint was skipped: then
    the chief drops it from the state file, so that rotation removes the
    damaged files and not the intact older checkpoints.
    """
    damaged = []
    if path is None:
      path, damaged = latest_intact(self.model_dir, self.restore_policy)
    elif damage(path) is not None:
      raise CheckpointError(f"checkpoint {path} is damaged: {damage(path)}")
    if path is None:
      return None
    try:
      # Read whole under either sharding (`sharding`'s docstring).
      status = self.checkpoint.restore(path)
      status.assert_existing_objects_matched()
    except (ValueError, AssertionError, tf.errors.OpError) as e:
      spike_problem = self._spike_window_problem(path)
      if spike_problem:
        raise CheckpointError(spike_problem) from None
      raise CheckpointError(
          f"checkpoint {path} does not match this model and optimizer "
          f"({first_line(e)}); use another model_dir or the same model "
          "flags") from None
    self._check_run_config(path)
    if damaged and self.is_chief:
      self._forget(damaged)
    logging.info("Restored checkpoint %s", path)
    return path

  def _spike_window_problem(self, path):
    """Why `path` cannot restore this run's spike window (a spike policy
    added to a run trained without one, another window), or None."""
    window = getattr(self.checkpoint, "spike_window", None)
    if window is None:
      return None
    shapes = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    saved = shapes.get("spike_window/losses/.ATTRIBUTES/VARIABLE_VALUE")
    if saved is None:
      return (f"spike_policy={window.policy}: checkpoint {path} was trained "
              "without a spike policy, so it has no spike window to resume; "
              "relaunch this run with spike_policy=none or start a new "
              "model_dir")
    if list(saved) != [window.window]:
      return (f"spike_window={window.window}: checkpoint {path} holds a "
              f"window of {saved[0]} steps; relaunch with "
              f"spike_window={saved[0]}")
    return None

  def _forget(self, damaged):
    """Rewrites the state file without the damaged checkpoints."""
    state = tf.train.get_checkpoint_state(self.directory)
    bad = {os.path.basename(p) for p, _ in damaged}
    keep = [(os.path.basename(p), t) for p, t in zip(
        state.all_model_checkpoint_paths,
        list(state.all_model_checkpoint_timestamps) or [None] * len(
            state.all_model_checkpoint_paths))
            if os.path.basename(p) not in bad]
    fresh = type(state)()
    fresh.model_checkpoint_path = keep[-1][0]
    fresh.all_model_checkpoint_paths.extend(name for name, _ in keep)
    if all(t is not None for _, t in keep):
      fresh.all_model_checkpoint_timestamps.extend(t for _, t in keep)
    fresh.last_preserved_timestamp = state.last_preserved_timestamp
    run_files.write_text(os.path.join(self.directory, "checkpoint"),
                      text_format.MessageToString(fresh))
    logging.warning("Dropped the damaged %s from %s/checkpoint",
                    ", ".join(sorted(bad)), self.directory)
    self.manager = self._new_manager()

  def _check_run_config(self, path):
    """CheckpointError (or a warning, if allowed) when the run's config
    differs from the one the checkpoints were written with
    (`run_config.compare`)."""
    if self.run_config is None:
      return
    changes = run_config_lib.compare(
        path, read_run_config(self.model_dir), self.run_config,
        allow_config_change=self.allow_config_change)
    if changes:
      self.config_changes = changes

  def _failed_save(self, step, error):
    """Removes what the failed save of `step` wrote; returns the line that
    names the folder, the OS's reason, the space needed and the last good
    checkpoint.

    A full disk stays full otherwise: the saver's `ckpt-<step>_temp` folder
    (megabytes of partial shards) is never reused.
    """
    prefix = os.path.join(self.directory, f"ckpt-{step}")
    for path in tf.io.gfile.glob(prefix + "_temp*") + tf.io.gfile.glob(
        prefix + ".*.tempstate*"):
      if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
      elif tf.io.gfile.exists(path):
        tf.io.gfile.remove(path)
    if (tf.io.gfile.glob(prefix + ".*") and prefix != self.latest
        and damage(prefix) is not None):
      for path in tf.io.gfile.glob(prefix + ".*"):
        tf.io.gfile.remove(path)
    if not self.is_chief:
      shutil.rmtree(self.directory, ignore_errors=True)
    line = (f"cannot write checkpoint ckpt-{step} in {self.directory} "
            f"({_save_reason(error)}): it needs about "
            f"{_megabytes(self._checkpoint_bytes())}")
    free = _free_bytes(self.model_dir)
    if free is not None:
      line += f", {_megabytes(free)} free there"
    line += f"; the partial ckpt-{step} was removed; "
    latest = self.latest
    if latest:
      line += f"the last good checkpoint is {latest} (unchanged)"
    else:
      line += "there is no earlier checkpoint"
    return line

  def _checkpoint_bytes(self):
    """The size of the newest checkpoint's files, else of the variables."""
    latest = self.latest
    if latest:
      files = tf.io.gfile.glob(latest + ".*")
      if files:
        return sum(tf.io.gfile.stat(f).length for f in files)
    total = 0
    for obj in tf.train.TrackableView(self.checkpoint).descendants():
      if isinstance(obj, (tf.Variable, keras.Variable)):
        shape = tf.TensorShape(obj.shape)
        if shape.is_fully_defined():
          total += shape.num_elements() * tf.as_dtype(obj.dtype).size
    return total

  def save(self, step):
    """Saves at `step`; every worker must call this (it is a collective).

    With `async_checkpoint`, returns once the checkpoint is serialized in
    memory: its files are written in the background, under temporary
    names, and listed (the oldest dropped) only once complete; a failed
    write is raised at the next save or by `wait`.
    """
    if self.async_checkpoint:
      return self._save_in_background(step)
    try:
      with sharding_lib.active(self.sharding):
        path = self.manager.save(checkpoint_number=step,
                                 options=self._options)
    except cluster.TRANSPORT_ERRORS:
      # A variable on another task (a model-parallel stage) could not be
      # read: the task died, not the disk. The caller reports the cluster.
      raise
    except tf.errors.OpError as e:
      raise ModelDirError(self._failed_save(step, e)) from None
    if not self.is_chief:
      shutil.rmtree(self.directory, ignore_errors=True)
      return None
    self._write_run_config()
    logging.info("Saved checkpoint %s", path)
    return path

  def _write_run_config(self):
    if self.run_config is not None:
      run_files.write_text(os.path.join(self.model_dir, RUN_CONFIG_FILE),
                        json.dumps(self.run_config, indent=2, sort_keys=True))

  def _save_in_background(self, step):
    """The same checkpoint as `save`, serialized to memory (TensorFlow's
    ram:// filesystem) on this thread; a thread writes it to the folder."""
    self.wait()  # one write at a time; the previous one's error first
    if self._staging is None:
      self._staging = tf.train.CheckpointManager(
          self.checkpoint, f"ram://distloop/{uuid.uuid4().hex}",
          max_to_keep=1, checkpoint_name="ckpt")
    try:
      staged = self._staging.save(checkpoint_number=step)
    except tf.errors.OpError as e:
      raise ModelDirError(self._failed_save(step, e)) from None
    self._pending = (step, threading.Thread(
        target=self._write_staged, args=(staged, step),
        name=f"checkpoint-{step}"))
    self._pending[1].start()
    self._write_run_config()
    logging.info("Writing checkpoint ckpt-%d in the background", step)
    return os.path.join(self.directory, f"ckpt-{step}")

  def _write_staged(self, staged, step):
    """(Background.) Copies the staged files under temporary names, renames
    them into place (data files first, the index last), then lists the
    checkpoint and drops the oldest, as TensorFlow's manager does."""
    try:
      files = sorted(tf.io.gfile.glob(staged + ".*"),
                     key=lambda f: f.endswith(".index"))
      final = [os.path.join(self.directory, os.path.basename(f))
               for f in files]
      temporary = [f"{f}.tempstate{uuid.uuid4().int % 10**12}"
                   for f in final]
      for source, target in zip(files, temporary):
        tf.io.gfile.copy(source, target, overwrite=True)
        tf.io.gfile.remove(source)  # the memory it held
      for hook in _WRITE_HOOKS:
        hook(os.path.join(self.directory, f"ckpt-{step}"))
      for source, target in zip(temporary, final):
        tf.io.gfile.rename(source, target, overwrite=True)
      self._list(os.path.join(self.directory, f"ckpt-{step}"))
    except Exception as e:  # pylint: disable=broad-except
      self._write_error = e  # raised on the step thread, by `wait`

  def _list(self, path):
    """Records `path` as the newest checkpoint in the state file, then
    removes the checkpoints beyond `max_to_keep` (oldest first)."""
    state = tf.train.get_checkpoint_state(self.directory)
    listed = [p for p in (state.all_model_checkpoint_paths if state else ())
              if os.path.basename(p) != os.path.basename(path)]
    names = [os.path.basename(p) for p in listed] + [os.path.basename(path)]
    drop, keep = names[:-self._max_to_keep], names[-self._max_to_keep:]
    fresh = tf.compat.v1.train.generate_checkpoint_state_proto(
        self.directory, keep[-1], all_model_checkpoint_paths=keep)
    fresh.model_checkpoint_path = keep[-1]
    del fresh.all_model_checkpoint_paths[:]
    fresh.all_model_checkpoint_paths.extend(keep)
    run_files.write_text(os.path.join(self.directory, STATE_FILE),
                         text_format.MessageToString(fresh))
    for name in drop:
      for old in tf.io.gfile.glob(os.path.join(self.directory, name) + ".*"):
        tf.io.gfile.remove(old)

  def wait(self):
    """Waits for the background write in flight (if any); ModelDirError,
    in one line, if it failed (its partial files removed)."""
    pending, self._pending = self._pending, None
    if pending is None:
      return
    step, thread = pending
    thread.join()
    error, self._write_error = self._write_error, None
    if error is not None:
      raise ModelDirError(self._failed_save(step, error))
    self.manager = self._new_manager()  # the state file the thread wrote
    logging.info("Saved checkpoint %s", self.latest)


# Test-only: `fn(prefix)` called in each background write once its files
# are copied under temporary names, before they are renamed and listed (a
# test makes the write fail, or dies in it).
_WRITE_HOOKS = []


def check_async(strategy):
  """ConfigError unless `strategy` trains in one process (what
  async_checkpoint supports: a background write of one process's copy)."""
  if strategies.task_info(strategy)[0] is not None:  # a cluster's task
    raise ConfigError(ASYNC_ONE_PROCESS)


ASYNC_ONE_PROCESS = (
    "async_checkpoint=True writes one process's checkpoints in the "
    "background; this run has several processes (multi_worker_mirrored, "
    "parameter_server or a mesh across processes), whose saves are "
    "collective: use async_checkpoint=False")


# The names distloop gives the objects of a run's checkpoint:
# `checkpoint_objects`' and `checkpoint_items`' (the loss scale's, the
# EMA's). tests/test_trainer_tracking.py checks that they cover them all.
OWN_NAMES = ("model", "optimizer", "global_step", "rng_states", "loss_scale",
             "loss_scale_good_steps", "ema", "spike_window")


def reserved_names() -> frozenset:
  """Names a tracked object cannot have: distloop's own (`OWN_NAMES`) and
  every attribute of a `tf.train.Checkpoint` (`save`, `restore`,
  `save_counter`, its private state), which the object would shadow."""
  return frozenset(OWN_NAMES).union(dir(tf.train.Checkpoint()))


def reserved_name_error(where: str, name: str) -> ConfigError:
  """The one-line error for tracking an object under a reserved name."""
  whose = ("distloop's checkpoint already uses" if name in OWN_NAMES
           else "tf.train.Checkpoint itself uses (an attribute the object "
           "would shadow)")
  public = sorted(n for n in reserved_names() if not n.startswith("_"))
  return ConfigError(
      f"{where}: {name!r} is a name {whose}; choose another (not one of "
      f"{', '.join(public)} or a private attribute of tf.train.Checkpoint)")


def tracked_elements(value: Any, label: str, where: Optional[str] = None):
  """Yields (label, object) for each object a tracked `value` holds: the
  value itself, or the elements of a list, tuple or dict of them, nested
  (tf.train.Checkpoint tracks those element by element), labelled
  `label[0]`, `label['key']`. With `where`, a dict key that is not a string
  (which a checkpoint cannot name) raises ConfigError in one line."""
  if isinstance(value, (list, tuple)):
    for i, element in enumerate(value):
      yield from tracked_elements(element, f"{label}[{i}]", where)
  elif isinstance(value, dict):
    for key, element in value.items():
      if where is not None and not isinstance(key, str):
        raise ConfigError(
            f"{where}: {label} has the key {key!r}, a "
            f"{type(key).__name__}; a checkpoint names a dict's elements by "
            "their keys, which must be strings")
      yield from tracked_elements(element, f"{label}[{key!r}]", where)
  else:
    yield label, value


def checkpoint_objects(trainer: Any,
                       extra: Optional[Mapping[str, Any]] = None) -> dict:
  """What a run's checkpoint holds: model, optimizer, global step, the
  model's random-generator state (a resumed run draws the same dropout
  masks), `extra` and the trainer's `tracked_objects`.

  Raises ConfigError, in one line, for a tracked name the checkpoint
  already uses (`reserved_names`).
  """
  objects = dict(model=trainer.model,
                 optimizer=protocols.checkpointed_optimizer(trainer),
                 global_step=trainer.global_step, **(extra or {}))
  rng_states = [v for v in trainer.model.variables
                if _tf_internal.is_seed_generator_state(v)]
  if rng_states:
    objects["rng_states"] = rng_states
  tracked = tracked_objects(trainer)
  reserved = reserved_names()
  for name in tracked:
    if name in objects or name in reserved:
      raise reserved_name_error(f"{type(trainer).__name__}.track({name}=...)",
                                name)
  objects.update(tracked)
  return objects


def tracked_objects(trainer: Any) -> dict:
  """The trainer's `tracked_objects` ({} by default).

  Raises ConfigError, in one line, for a keras.Model or optimizer attribute
  (or one in a list, tuple or dict attribute) of a trainer class of one's
  own that is neither its `model`/`optimizer` nor tracked: it would be left out of every checkpoint, so a resumed run
  would silently restart it.
  """
  tracked = dict(protocols.optional(trainer, "tracked_objects"))
  if type(trainer).__module__.startswith("framework."):
    return tracked  # the framework's own trainers declare theirs
  known = [trainer.model, trainer.optimizer]
  for name, value in tracked.items():
    known += [element for _, element in tracked_elements(value, name)]
  for name, value in sorted(vars(trainer).items()):
    # A list, tuple or dict attribute: its models and optimizers too.
    for label, element in tracked_elements(value, name):
      if (isinstance(element, (keras.Model, keras.optimizers.Optimizer))
          and not any(element is k for k in known)):
        kind = ("keras.Model" if isinstance(element, keras.Model)
                else "optimizer")
        raise ConfigError(
            f"{type(trainer).__name__}.{label} (a {kind}) is not "
            f"checkpointed: create it in __init__ under `with "
            f"self.strategy.scope():` and register it with "
            f"self.track({name}=self.{name})")
  return tracked


def checkpoint_items(trainer: Any) -> dict:
  """What a run checkpoints besides model, optimizer and step: the loss
  scale's, the EMA's and the spike window's state, where the trainer has
  them."""
  items = {}
  loss_scale = protocols.optional(trainer, "loss_scale")
  if loss_scale is not None:
    items.update(loss_scale.checkpoint_items())
  ema = protocols.optional(trainer, "ema")
  if ema is not None:
    items.update(ema.checkpoint_items())
  spikes = protocols.optional(trainer, "spikes")
  if spikes is not None:
    items["spike_window"] = spikes
  return items


def for_loop(parts, model_dir, *, max_to_keep=3, **options):
  """The `CheckpointManager` a `Controller` with `parts` (a
  `framework.core.controller.LoopParts`) saves through: its checkpoint holds
  `parts.checkpoint`; `options` are `CheckpointManager`'s
  (`restore_policy`, `run_config`, `allow_config_change`, `sharding`)."""
  return CheckpointManager(tf.train.Checkpoint(**parts.checkpoint), model_dir,
                           parts.strategy, max_to_keep=max_to_keep, **options)


def read_run_config(model_dir):
  """The dict the chief wrote with its checkpoints, or None."""
  return run_files.read_json(
      os.path.join(model_dir, RUN_CONFIG_FILE),
      "; delete it to resume without the configuration check",
      object_only=True)


# The `checkpoint` state file: read strictly, and rebuilt when garbled.
#
# TensorFlow's `get_checkpoint_state` logs a `ParseError` and returns None
# for a state file it cannot parse, which reads the same as no state file:
# a run with intact `ckpt-*` files would then look like one with no
# checkpoint at all. Here a state file that exists but does not parse (or is
# empty, or names no checkpoint) is *unreadable*, with the reason; the
# checkpoints are then found from their own files (`ckpt-<N>.index`,
# `ckpt-<N>.data-*`), and the training chief rewrites the state file from
# them, atomically, so that the next run reads it cleanly.
STATE_FILE = "checkpoint"
_CHECKPOINT_FILE = re.compile(r"ckpt-(\d+)\.(index|data-\d{5}-of-\d{5})")
# (directory, problem) pairs already warned about: `evaluate.py --watch`
# looks the checkpoints up on every poll.
_warned = set()


def _first_line(text):
  lines = str(text).strip().splitlines()
  return lines[0] if lines else ""


def _empty_state():
  # The public API builds a CheckpointState only through this function.
  state = tf.compat.v1.train.generate_checkpoint_state_proto("/", "/x")
  state.Clear()
  return state


def problem(directory):
  """Why `directory`'s state file is unreadable; None if it reads (or is
  absent: that is no state, not a damaged one)."""
  path = os.path.join(directory, STATE_FILE)
  if not tf.io.gfile.exists(path):
    return None
  try:
    with tf.io.gfile.GFile(path, "rb") as f:
      text = f.read().decode("utf-8")
  except UnicodeDecodeError:
    return "it is not text"
  except tf.errors.OpError as e:
    return f"it cannot be read: {_first_line(e.message)}"
  if not text.strip():
    return "it is empty"
  state = _empty_state()
  try:
    text_format.Merge(text, state)
  except text_format.ParseError as e:
    return f"it does not parse: {_first_line(e)}"
  if not state.model_checkpoint_path:
    return "it names no checkpoint (no model_checkpoint_path)"
  return None


def on_disk(directory):
  """The `ckpt-<N>` prefixes that have files in `directory`, oldest
  (lowest N) first; a prefix with only some of its files is included, so
  that the damage check names what is missing."""
  numbers = set()
  for name in tf.io.gfile.listdir(directory):
    match = _CHECKPOINT_FILE.fullmatch(name.rstrip("/"))
    if match:
      numbers.add(int(match.group(1)))
  return [os.path.join(directory, f"ckpt-{n}") for n in sorted(numbers)]


def recovered(directory):
  """The checkpoints found from their own files when the state file is
  unreadable (warned once per folder and reason), else None."""
  why = problem(directory)
  if why is None:
    return None
  found = on_disk(directory)
  if (directory, why) not in _warned:
    _warned.add((directory, why))
    logging.warning(
        "The checkpoint state file %s is unreadable (%s); using the "
        "checkpoints found from their own files: %s", os.path.join(
            directory, STATE_FILE), why,
        ", ".join(os.path.basename(p) for p in found) or "none")
  return found


def rebuild(directory):
  """Rewrites an unreadable state file from the checkpoints' own files
  (atomically; their files' times as the checkpoints' times), or
  removes it when there are none. Returns the reason it was unreadable,
  or None (nothing written)."""
  why = problem(directory)
  if why is None:
    return None
  path = os.path.join(directory, STATE_FILE)
  found = on_disk(directory)
  if not found:
    tf.io.gfile.remove(path)
    logging.warning("Removed the unreadable checkpoint state file %s (%s); "
                    "no checkpoint files beside it", path, why)
    return why
  names = [os.path.basename(p) for p in found]
  times = [max(tf.io.gfile.stat(f).mtime_nsec / 1e9
               for f in tf.io.gfile.glob(p + ".*")) for p in found]
  state = tf.compat.v1.train.generate_checkpoint_state_proto(
      directory, names[-1], all_model_checkpoint_paths=list(names),
      all_model_checkpoint_timestamps=times,
      # Older than every checkpoint: TensorFlow's manager never rotates
      # (nor lists again) one stamped at or before it.
      last_preserved_timestamp=min(times) - 1)
  run_files.write_text(path, text_format.MessageToString(state))
  logging.warning("The checkpoint state file %s was unreadable (%s); "
                  "rewrote it from the checkpoints' own files: %s", path,
                  why, ", ".join(names))
  return why


def latest(directory):
  """`tf.train.latest_checkpoint(directory)`, but from the checkpoints' own
  files when the state file is unreadable (the newest ckpt-<N>)."""
  found = recovered(directory)
  if found is None:
    return tf.train.latest_checkpoint(directory)
  return found[-1] if found else None


# Which checkpoints can be restored: read in full before trusting one.
#
# A checkpoint is intact when its index and every data file exist and every
# tensor reads back with a valid checksum. `latest_intact` walks the state
# file's list newest first and returns the newest intact one, naming each
# damaged newer one, so that a run killed mid-save or a disk that lost a file
# resumes from what is really there, never silently from scratch.
def damage(prefix):
  """None if checkpoint `prefix` reads back in full, else what is wrong.

  The answer names the damaged file: a missing index or data file, or a
  data file that is short or fails its checksum when every tensor is read.
  """
  index = prefix + ".index"
  if not tf.io.gfile.exists(index):
    return f"{index} is missing"
  data = sorted(tf.io.gfile.glob(prefix + ".data-*-of-*"))
  shards = {int(m.group(1)) for m in (re.search(r"-of-(\d+)$", d)
                                      for d in data) if m}
  for count in shards:
    for i in range(count):
      name = f"{prefix}.data-{i:05d}-of-{count:05d}"
      if name not in data:
        return f"{name} is missing"
  try:
    reader = tf.train.load_checkpoint(prefix)
  except Exception as e:  # pylint: disable=broad-except
    return f"{index} cannot be read ({first_line(e)})"
  try:
    for name in sorted(reader.get_variable_to_shape_map()):
      reader.get_tensor(name)
  except Exception as e:  # pylint: disable=broad-except
    named = re.search(r"\S+\.data-\d{5}-of-\d{5}", str(e))
    if named and not tf.io.gfile.exists(named.group(0)):
      return f"{named.group(0)} is missing"
    # The bundle reader names the shard ("shard 1") or nothing at all.
    shard = re.search(r"shard (\d+)", str(e))
    named = [d for d in data if shard and d.endswith(
        f".data-{int(shard.group(1)):05d}-of-{len(data):05d}")]
    files = " or ".join(named or data) or f"{prefix}.data-*"
    return f"{files} is damaged ({first_line(e)})"
  return None


def _listed_checkpoints(directory):
  """The checkpoints the state file lists, oldest first (None: no state).

  An unreadable state file (garbled, empty) is named in a warning and the
  checkpoints are those found from their own files.

  `get_checkpoint_state` joins relative entries onto the directory it is
  given, so an absolute directory makes every entry absolute, whatever form
  the state file stores.
  """
  directory = absolute(directory)
  found = recovered(directory)
  if found is not None:  # a garbled state file: the files themselves
    return found
  try:
    state = tf.train.get_checkpoint_state(directory)
  except Exception as e:  # pylint: disable=broad-except  (a parse error)
    raise CheckpointError(f"the checkpoint state file {directory}/checkpoint "
                          f"is corrupt ({first_line(e)})") from None
  if state is None:
    return None
  paths = list(state.all_model_checkpoint_paths)
  if state.model_checkpoint_path and state.model_checkpoint_path not in paths:
    paths.append(state.model_checkpoint_path)
  return [p if os.path.isabs(p) or "://" in p else os.path.join(directory, p)
          for p in paths]


def absolute(path):
  """`path` made absolute, unless it is a URL (gs://, hdfs://, ...)."""
  return path if "://" in path else os.path.abspath(path)


def has_checkpoint(directory):
  """Whether a run in `directory` resumes from a checkpoint (or refuses to
  start from scratch): some checkpoint it lists has files there, as
  `latest_intact` decides. Reads only the listing, no tensor."""
  if not directory:
    return False
  if problem(absolute(directory)) is not None:
    # A garbled state file: the files themselves, quietly (the restore
    # names the state file, once).
    return bool(on_disk(absolute(directory)))
  try:
    paths = _listed_checkpoints(directory) or []
  except CheckpointError:
    return False  # the restore names the problem
  return any(tf.io.gfile.glob(p + ".*") for p in paths)


def latest_intact(directory, restore_policy="latest_intact", *, warn=True):
  """(newest intact checkpoint or None, [(damaged path, problem), ...]).

  Reads only. Damaged checkpoints newer than the one returned are logged as
  warnings (unless `warn` is False: the restore names them). Raises CheckpointError if the newest is damaged and the policy
  is "error", or if checkpoint files exist but none is intact.
  """
  check_choice("restore_policy", restore_policy, RESTORE_POLICIES)
  paths = _listed_checkpoints(directory) or []
  damaged = []
  for path in reversed(paths):
    problem = damage(path)
    if problem is None:
      for bad, why in damaged if warn else ():
        logging.warning("Checkpoint %s is damaged: %s; restoring the newest "
                        "intact checkpoint, %s, instead", bad, why, path)
      return path, damaged
    if restore_policy == "error":
      raise CheckpointError(
          f"checkpoint {path} is damaged: {problem}; restore the file, or "
          "use restore=latest_intact to resume from the newest intact "
          "checkpoint")
    damaged.append((path, problem))
  if any(tf.io.gfile.glob(p + ".*") for p, _ in damaged):
    raise CheckpointError(
        "no intact checkpoint to resume from: " + "; ".join(
            why for _, why in damaged) + "; refusing to start from scratch: "
        "restore the files or move the ckpt-* files away")
  if damaged:
    logging.warning("The checkpoint state in %s lists %s but none of their "
                    "files exist; starting from scratch", directory,
                    ", ".join(os.path.basename(p) for p, _ in damaged))
  return None, []
