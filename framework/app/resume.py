"""May this run continue from that folder, and from which checkpoint.

A launch decides, in this order (`experiment.run` calls `resume` between
building the run and running it; nothing in model_dir is written before):

1. the previous launch's model_info.json (`export.read_model_info_quietly`;
   None: a new run), which also fixed the model's input scale before the
   build (`run_plan.with_recorded_scale`);
2. the split checks (`check_resume`): a checkpoint whose keys are a Dense
   pair's own tensor split resumes only as that split
   (`check_split_change`), a gpt split's checkpoint from before cross-mesh
   resume is refused, naming the migration script
   (`saved_before_cross_mesh`);
3. which checkpoint: the newest intact one, or an error under
   `restore=error` (`manager.latest_intact`, read in full);
4. restore, then the run_config comparison: the checkpoints'
   run_config.json against this run's (`run_config`: model, options,
   optimizer, global batch, dataset, the model's fingerprint) is an error,
   or a warning with `allow_config_change` (`core.checkpoints.run_config
   .compare`, called by the manager's restore so that a Controller-only
   user gets it too);
5. a warm start (`init_checkpoint`), only when no checkpoint was restored;
6. the changes recorded: model_info.json's `config_changes` gets this
   resume's allowed changes, a re-stretched learning-rate schedule and a
   changed model split (`config_changes`, `change_entry`).

The checkpoint manager (`framework.core.checkpoints.manager`) only writes,
finds and restores.
"""

import hashlib
import inspect
import json

from absl import logging

import models
from models import input_scale
from framework.core import optimizers, protocols, spikes
from framework.core.checkpoints import manager, warm_start
from framework.core.checkpoints.run_config import compare as compare_run_config  # pylint: disable=unused-import
from framework.errors import CheckpointError, ConfigError
from framework.model_parallel.config import ModelParallelConfig
from framework.settings import default

MODEL_INFO_FILE = "model_info.json"
# Options that change how a model trains but not its weights.
TRAINING_ONLY_OPTIONS = {"sync_batch_norm": False}


def resume(plan, trainer, controller, *, previous, describe):
  """Restores the run's latest checkpoint (or warm starts a new run);
  returns the model_info.json to write. Nothing is written before.

  Args:
    plan: the run's `RunPlan`.
    trainer: its trainer.
    controller: its `Controller` (and through it the `CheckpointManager`).
    previous: the model_dir's model_info.json (None: a new run).
    describe: `() -> dict`, the run's model_info (`export.model_info` and
      `export.data_sources`), called after the restore.
  """
  config = plan.config
  # A checkpoint this split cannot read: one line, before the restore.
  own_keys = check_resume(plan, previous, trainer, controller.checkpoints)
  # Restore (or fail on a mismatched checkpoint) before writing anything.
  if own_keys:
    restore_own_keys(trainer, controller)
  else:
    controller.restore()
  # Only when the run has no checkpoint of its own.
  init = warm_start.warm_start(
      controller, config.init_checkpoint,
      skip_mismatch=config.init_skip_mismatch, exclude=config.init_exclude)
  record = plan.record()
  if record["model_parallel"]["mode"] != "none":  # which trainer ran
    record["model_parallel"]["trainer"] = type(trainer).__name__
  info = dict(describe(),
              # How the model was built: evaluate.py, predict.py and a
              # resume build it the same.
              **{input_scale.RECORD: input_scale.wrapped(
                  protocols.unsplit_model(trainer))},
              train_steps=controller.config.train_steps,
              run_plan=record)
  # A relaunch keeps the record of the warm start its first launch did.
  init = init or (previous or {}).get("init_checkpoint")
  if init:
    info["init_checkpoint"] = init
  info.update(config_changes(
      previous, controller, config,
      change_entry(previous, record["model_parallel"], controller.step)))
  return info


def check_async_checkpoint(config):
  """ConfigError, before anything is written, for `async_checkpoint` in a
  run of several processes (`manager.check_async` says why)."""
  loop = config.loop
  if not (loop is not None and loop.async_checkpoint):
    return
  if (config.strategy in ("multi_worker_mirrored", "parameter_server")
      or config.model_parallel.devices == "cluster"):
    raise ConfigError(manager.ASYNC_ONE_PROCESS.replace(
        "this run has several processes", "this run has several processes "
        f"(strategy={config.strategy}, model_parallel_devices="
        f"{config.model_parallel.devices})"))


# What a checkpoint must agree on with the run resuming from it.


def jsonable(options):
  """`options` with tuples as lists (as JSON gives them back)."""
  return {k: list(v) if isinstance(v, tuple) else v
          for k, v in (options or {}).items()}


def run_config(config, model=None):
  """What a checkpoint must agree on with the run resuming from it.

  Only the options the model takes count (train.py passes every model's).
  With the built `model`, also its `model_fingerprint`, so that a model
  function edited to build other layers of the same shapes is noticed.
  """
  accepted = inspect.signature(models.get_builder(config.model)).parameters
  options = {k: v for k, v in jsonable(config.model_options).items()
             if k in accepted and k not in TRAINING_ONLY_OPTIONS}
  return {"model": config.model, "model_options": options,
          "optimizer": config.optimizer.name,
          "global_batch_size": config.global_batch_size,
          "dataset": config.dataset,
          **({"model_fingerprint": model_fingerprint(model)}
             if model is not None else {})}


# Layer config keys that do not make another model: the auto-numbered
# name, the compute dtype (--mixed_precision) and synchronized
# (--sync_batch_norm: training only).
_NOT_ARCHITECTURE = ("name", "dtype", "synchronized")


def model_fingerprint(model):
  """16 hex digits of sha256 over the model's layers, in order: each one's
  class, its config (plain JSON values only, without `_NOT_ARCHITECTURE`)
  and its weights' shapes. Equal code gives equal fingerprints in any
  process; other activations, sizes or layers give another."""

  def plain(value):
    if isinstance(value, dict):
      return {str(k): plain(v) for k, v in value.items()
              if k not in _NOT_ARCHITECTURE}
    if isinstance(value, (list, tuple)):
      return [plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
      return value
    return type(value).__name__  # no reprs with addresses

  def layers(layer):
    for sub in getattr(layer, "layers", ()):
      yield sub
      yield from layers(sub)

  parts = []
  for layer in layers(model):
    try:
      config = layer.get_config()
    except (NotImplementedError, TypeError, ValueError):
      config = None
    parts.append([type(layer).__name__, plain(config),
                  [list(w.shape) for w in layer.weights]])
  text = json.dumps(parts, sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_changes(previous, controller, config, split_entry=None):
  """{"config_changes": [...]} for model_info.json: the earlier entries
  (of `previous`, the model_dir's model_info.json), plus this resume's if
  `allow_config_change` let the configuration change, a longer (shorter)
  run re-stretched a decaying learning-rate schedule or the model split
  changed (`split_entry`, already logged); each is logged; {} if there
  never was one."""
  previous = previous or {}
  history = list(previous.get("config_changes") or [])
  step = controller.step
  entry = {key: {"was": old, "now": new}
           for key, old, new in controller.checkpoints.config_changes}
  if entry:
    logging.warning(
        "%s now describes the changed configuration (%s) and records the "
        "change at step %d under config_changes", MODEL_INFO_FILE,
        ", ".join(entry), step)
  rollbacks = getattr(controller, "rollbacks", None)
  if "global_batch_size" in entry and rollbacks and rollbacks.skipped:
    # The record holds batch indices, not examples: the same indices now
    # name other examples, so the examples the rollbacks dropped are
    # trained on and others are skipped.
    logging.warning(
        "%s skips batches %s, indices counted in batches of "
        "global_batch_size=%s; at %s they are other examples (remove the "
        "file to skip none)", rollbacks.path,
        spikes.batches_text(rollbacks.skipped),
        entry["global_batch_size"]["was"], entry["global_batch_size"]["now"])
  was, now = previous.get("train_steps"), controller.config.train_steps
  schedule = config.optimizer.schedule
  if (step and was and was != now and step < now
      and schedule in optimizers.DECAYING_SCHEDULES
      and not config.optimizer.total_steps):
    entry["train_steps"] = {"was": was, "now": now}
    entry["lr_schedule"] = {"was": f"{schedule} over {was} steps",
                            "now": f"{schedule} over {now} steps"}
    logging.warning(
        "train_steps was %d, now %d: the %s learning-rate schedule now spans "
        "%d steps, so from step %d on the rate differs from the first "
        "launch's (recorded in %s under config_changes)", was, now,
        schedule, now, step, MODEL_INFO_FILE)
  entry.update(split_entry or {})
  if entry:
    history.append({"step": step, **entry})
  return {"config_changes": history} if history else {}


# A run resumed on another model split: said in one line, or refused.
#
# A checkpoint holds the unsplit model's weights and optimizer state under
# the unsplit model's keys wherever the split keeps them so (a layer-cut
# pipeline, a model's whole-model split such as the gpt's: every mesh), so a
# run trained on one mesh resumes on another, or on none. The relaunch logs
# the change in one line and model_info.json records it under
# `config_changes`. The one split whose checkpoint is its own is the tensor
# split of one Dense pair (a model without a whole-model split): its shards
# sit under their own keys, so it resumes only as itself; any other change
# to or from it is one line naming the flag, before anything is restored or
# written. A gpt split's checkpoint from before cross-mesh resume (its
# optimizer under the split's own keys) is refused in one line naming
# scripts/migrate_split_checkpoint.py, which migrates it once.

MIGRATE_SCRIPT = "scripts/migrate_split_checkpoint.py"

# The flags that choose a split, as model_info.json's run_plan records them.
_FLAGS = (("mesh", "mesh"), ("model_parallel", "mode"),
          ("num_shards", "num_shards"), ("num_stages", "num_stages"))


def split_flags(record):
  """{flag: value} of the split a run_plan `model_parallel` record
  describes (only the flags its mode reads)."""
  record = record or {}
  mode = record.get("mode", default(ModelParallelConfig, "mode"))
  flags = {"mesh": record.get("mesh") or "", "model_parallel": mode}
  if mode == "tensor":
    flags["num_shards"] = record.get("num_shards")
  if mode == "pipeline":
    flags["num_stages"] = record.get("num_stages")
  return flags


def describe(record):
  """`mesh=data:2,model:2`, `model_parallel=pipeline num_stages=2` or
  `none`: the split of a run_plan `model_parallel` record."""
  flags = split_flags(record)
  if flags["mesh"]:
    return f"mesh={flags['mesh']}"
  if flags["model_parallel"] == "none":
    return "none"
  return " ".join(f"{k}={v}" for k, v in flags.items() if k != "mesh")


def changed_flags(was, now):
  """[(flag, old value, new value)] between two `model_parallel` records."""
  old, new = split_flags(was), split_flags(now)
  return [(flag, old.get(flag), new.get(flag))
          for flag, _ in _FLAGS if old.get(flag) != new.get(flag)]


def _own_keys(record, whole_split):
  """Whether the split's checkpoint keys are its own (a Dense-pair tensor
  split), not the unsplit model's."""
  return (record or {}).get("mode") == "tensor" and not whole_split


def check_split_change(previous_info, record, *, model, whole_split,
                       own_keys=None):
  """Raises ConfigError when the run resumes a checkpoint written under
  another split that cannot restore into this one.

  Args:
    previous_info: the model_dir's model_info.json (None: a new run).
    record: this run's run_plan `model_parallel` record.
    model: the model's name (for the message).
    whole_split: whether the model has a whole-model split (`gpt`).
    own_keys: whether the checkpoint holds a Dense pair split under its own
      keys (`tensor_parallel.own_keys_checkpoint`; None: guessed from the
      records, as a split of one Dense pair once always saved).
  """
  was = ((previous_info or {}).get("run_plan") or {}).get("model_parallel")
  if was is None:
    return
  changes = changed_flags(was, record)
  if own_keys is None:
    own_keys = (_own_keys(was, whole_split)
                or _own_keys(record, whole_split))
  if not changes or not own_keys:
    return
  what = "; ".join(f"{flag} was {_show(old)}, now {_show(new)}"
                   for flag, old, new in changes)
  raise ConfigError(
      f"resuming on another model split is not supported for model={model} "
      f"({what}): its checkpoint holds a tensor split of one Dense pair "
      f"under the shards' own keys; resume with {describe(was)} once (its "
      "next checkpoints have the unsplit model's keys) or use another "
      "model_dir")


def check_resume(plan, previous_info, trainer, checkpoints):
  """Before a run's first restore: ConfigError when its latest checkpoint
  cannot resume on this split (`check_split_change`) or was saved before
  cross-mesh resume (`saved_before_cross_mesh`: migrate it first).

  Args:
    plan: this run's `RunPlan`.
    previous_info: the model_dir's model_info.json (None: a new run).
    trainer: the run's trainer.
    checkpoints: its `CheckpointManager`.

  Returns:
    True when the checkpoint holds this Dense pair split under its own
    keys (`restore_own_keys` reads it).
  """
  path = checkpoints.latest
  record = plan.record()["model_parallel"]
  was = ((previous_info or {}).get("run_plan") or {}).get("model_parallel")
  if not path or "tensor" not in ((was or {}).get("mode"), record["mode"]):
    return  # only a tensor split's checkpoint keys can be its own (or older)
  # pylint: disable=g-import-not-at-top
  from framework.model_parallel.parallel_layers import split_for
  from framework.model_parallel.tensor_parallel import own_keys_checkpoint
  # pylint: enable=g-import-not-at-top
  unsplit = protocols.unsplit_model(trainer)
  whole_split = split_for(unsplit) is not None
  if not whole_split:
    # The keys of the checkpoint the restore reads: a damaged newer one is
    # skipped, so it says nothing of the older one's layout.
    try:
      path, _ = manager.latest_intact(checkpoints.model_dir,
                                      checkpoints.restore_policy, warn=False)
    except CheckpointError:
      path = None  # the restore names it in one line
  own_keys = bool(path) and not whole_split and own_keys_checkpoint(path)
  check_split_change(previous_info, record, model=plan.config.model,
                     whole_split=whole_split, own_keys=own_keys)
  if own_keys:
    return True
  if whole_split and saved_before_cross_mesh(
      previous_info, manager.read_run_config(checkpoints.model_dir),
      model_fingerprint(unsplit)):
    raise ConfigError(
        f"checkpoint {path} was saved before cross-mesh resume (its "
        "optimizer under the keys of its own split, "
        f"{describe(previous_info['run_plan']['model_parallel'])}): migrate "
        f"it once with python {MIGRATE_SCRIPT} and that run's flags, then "
        "relaunch; or use another model_dir")


def restore_own_keys(trainer, controller):
  """`controller.restore()` of a checkpoint that holds a Dense pair split
  under its own keys (as distloop saved one before it saved the unsplit
  model's keys): read as such, against the split model's fingerprint (what
  such a run recorded in run_config.json). The next checkpoints have the
  unsplit model's keys."""
  checkpoints = controller.checkpoints
  recorded = checkpoints.run_config
  if recorded is not None:
    checkpoints.run_config = dict(
        recorded, model_fingerprint=model_fingerprint(trainer.model))
  trainer.read_own_keys(True)
  try:
    controller.restore()
  finally:
    trainer.read_own_keys(False)
    checkpoints.run_config = recorded
  logging.info("read %s as a Dense pair split's own keys; its next "
               "checkpoints have the unsplit model's", controller.restored_from)


def saved_before_cross_mesh(previous_info, saved_run_config,
                            unsplit_fingerprint):
  """Whether a gpt tensor split wrote the checkpoints before cross-mesh
  resume (before commit 54c2082): model_info.json's run_plan says a tensor
  split and the checkpoints' run_config.json records not the unsplit
  model's fingerprint (that distloop recorded the split model's)."""
  was = ((previous_info or {}).get("run_plan") or {}).get("model_parallel")
  fingerprint = (saved_run_config or {}).get("model_fingerprint")
  return ((was or {}).get("mode") == "tensor" and fingerprint is not None
          and fingerprint != unsplit_fingerprint)


def change_entry(previous_info, record, step):
  """{"model_parallel": {"was", "now"}} for config_changes when this run
  resumed at `step` on another split than the checkpoint's ({} if not);
  logs it in one line."""
  was = ((previous_info or {}).get("run_plan") or {}).get("model_parallel")
  if not step or was is None or not changed_flags(was, record):
    return {}
  old, new = describe(was), describe(record)
  logging.warning(
      "model split changed: was %s, now %s (%s); resuming at step %d from "
      "the checkpoint's whole weights and optimizer state (recorded in "
      "model_info.json under config_changes)", old, new,
      ", ".join(f"--{flag}" for flag, _, _ in changed_flags(was, record)),
      step)
  return {"model_parallel": {"was": old, "now": new}}


def _show(value):
  return "unset" if value in ("", None) else value
