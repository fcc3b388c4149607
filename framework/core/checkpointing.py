"""Checkpoints that resume exactly and are safe with several workers.

Every worker must take part in a multi-worker save (the save is a collective);
only the chief's copy is kept, the others write to a temporary directory that
is removed straight after. A checkpoint that cannot be restored is an error,
never a silent restart from scratch.

Before restoring, the newest checkpoint is read in full
(`checkpoint_integrity`). A damaged one is named in a warning and the newest
intact one is restored instead (`restore_policy="latest_intact"`), or it is
an error (`"error"`). The chief also keeps `run_config.json` beside the
checkpoints (model, options, optimizer, global batch, dataset), so that
resuming with another configuration is an error unless allowed.
"""

import contextlib
import json
import os
import re
import shutil

from absl import logging
from google.protobuf import text_format
import keras
import tensorflow as tf

from framework.core import atomic, checkpoint_state
from framework.core.checkpoint_integrity import (absolute, damage,
                                                 latest_intact)
from framework.core.config import RESTORE_POLICIES
from framework.distribute import cluster, strategies
from framework.errors import (CheckpointError, ModelDirError, check_choice,
                              check_positive, first_line)

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
    r"|" + atomic.ORPHAN_NAMES.pattern)


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


def _describe(value):
  return json.dumps(value, sort_keys=True)


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
    allow_config_change: a changed `run_config` is a warning, not an error.
  """

  def __init__(self, checkpoint, model_dir, strategy, *, max_to_keep=3,
               restore_policy="latest_intact", run_config=None,
               allow_config_change=False):
    check_positive("keep_checkpoints", max_to_keep)
    self.checkpoint = checkpoint
    # Resolved once: TensorFlow's state file and this class join paths onto
    # the directory, and a relative one would be joined twice.
    model_dir = absolute(model_dir)
    self.model_dir = model_dir
    self.is_chief = strategies.is_chief(strategy)
    self._accepted, self._consume_all = {}, False
    self.configure(restore_policy=restore_policy, run_config=run_config,
                   allow_config_change=allow_config_change)
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

  def configure(self, *, restore_policy="latest_intact", run_config=None,
                allow_config_change=False):
    """Sets the restore policy and the configuration checked on resume."""
    self.restore_policy = check_choice("restore_policy", restore_policy,
                                       RESTORE_POLICIES)
    self.run_config = run_config
    self.allow_config_change = bool(allow_config_change)
    # [(key, old, new)] an allowed resume changed (see _check_run_config).
    self.config_changes = []

  @contextlib.contextmanager
  def restoring_older(self, **accepted):
    """Within: a restore accepts the `run_config` values an older version
    wrote (`{key: value}`, e.g. another model_fingerprint) as unchanged,
    and fails unless it consumes every value the checkpoint holds."""
    self._accepted, self._consume_all = dict(accepted), True
    try:
      yield
    finally:
      self._accepted, self._consume_all = {}, False

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
    checkpoint_state.rebuild(self.directory)
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
      status = self.checkpoint.restore(path)
      status.assert_existing_objects_matched()
      if self._consume_all:
        status.assert_consumed()
    except (ValueError, AssertionError, tf.errors.OpError) as e:
      raise CheckpointError(
          f"checkpoint {path} does not match this model and optimizer "
          f"({first_line(e)}); use another model_dir or the same model "
          "flags") from None
    self._check_run_config(path)
    if damaged and self.is_chief:
      self._forget(damaged)
    logging.info("Restored checkpoint %s", path)
    return path

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
    atomic.write_text(os.path.join(self.directory, "checkpoint"),
                      text_format.MessageToString(fresh))
    logging.warning("Dropped the damaged %s from %s/checkpoint",
                    ", ".join(sorted(bad)), self.directory)
    self.manager = self._new_manager()

  def _check_run_config(self, path):
    """CheckpointError (or a warning, if allowed) when the run's config
    differs from the one the checkpoints were written with."""
    if self.run_config is None:
      return
    saved = read_run_config(self.model_dir)
    if saved is None:
      return
    current = json.loads(json.dumps(self.run_config))
    # A key the checkpoints' run_config.json lacks (written by an older
    # version) is not a change.
    changes = [(k, saved.get(k), current.get(k))
               for k in sorted(set(saved) | set(current))
               if k in saved and saved.get(k) != current.get(k)
               and not (k in self._accepted and
                        saved.get(k) == self._accepted[k])]
    if not changes:
      return
    what = "; ".join(f"{k} was {_describe(old)}, now {_describe(new)}"
                     for k, old, new in changes)
    if any(k == "model_fingerprint" for k, _, _ in changes):
      what += (" (the model's layers differ from the checkpoint's, e.g. "
               "other activations: the model's code changed)")
    if self.allow_config_change:
      logging.warning("Resuming %s with a changed configuration (allowed): "
                      "%s", path, what)
      self.config_changes = changes
      return
    raise CheckpointError(
        f"checkpoint {path} was written with another configuration: {what}; "
        "use the same flags, another model_dir, or allow_config_change to "
        "resume anyway (e.g. fine-tuning)")

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
    """Saves at `step`; every worker must call this (it is a collective)."""
    try:
      path = self.manager.save(checkpoint_number=step)
    except cluster.TRANSPORT_ERRORS:
      # A variable on another task (a model-parallel stage) could not be
      # read: the task died, not the disk. The caller reports the cluster.
      raise
    except tf.errors.OpError as e:
      raise ModelDirError(self._failed_save(step, e)) from None
    if not self.is_chief:
      shutil.rmtree(self.directory, ignore_errors=True)
      return None
    if self.run_config is not None:
      atomic.write_text(os.path.join(self.model_dir, RUN_CONFIG_FILE),
                        json.dumps(self.run_config, indent=2, sort_keys=True))
    logging.info("Saved checkpoint %s", path)
    return path


def read_run_config(model_dir):
  """The dict the chief wrote with its checkpoints, or None."""
  path = os.path.join(model_dir, RUN_CONFIG_FILE)
  if not tf.io.gfile.exists(path):
    return None
  try:
    with tf.io.gfile.GFile(path) as f:
      return json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path} is not valid JSON ({e}); delete it to "
                          "resume without the configuration check") from None

