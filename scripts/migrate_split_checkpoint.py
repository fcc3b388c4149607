"""Migrates a gpt split's checkpoint saved before cross-mesh resume, once;
takes train.py's flags, those of the run that wrote it.

    python scripts/migrate_split_checkpoint.py --model=gpt --dataset=text \
        --mesh=data:2,model:2 --cpu_devices=4 ... --model_dir=runs/gpt

distloop before cross-mesh resume (before commit 54c2082) saved a
transformer tensor split's optimizer under the split optimizer's own keys
and shapes, and recorded the split model's fingerprint in run_config.json.
`train.py` refuses such a model_dir in one line naming this script. Run it
once with the flags of the run that wrote the checkpoint (train.py's
flags; the split flags, model and optimizer must be that run's): it builds
that run's split trainer, restores the latest checkpoint into the split
optimizer itself (every value the checkpoint holds must be consumed) and
saves it again at the same step as an unsplit run's, with the unsplit
model's fingerprint. From then on the run resumes on any mesh, or on none;
resumed on its own split it continues exactly (weights and optimizer
slots). Earlier checkpoints of the folder stay as they were, and the one
migrated is kept as it was in <model_dir>/before_migration/ (delete it once
the run resumes): the new one is saved under the same name, and a
migration killed or failing half-way reads the kept copy when run again.
"""

from absl import app  # pylint: disable=g-import-not-at-top
try:  # Installed: the package distloop_cli.
  from . import cli  # pylint: disable=g-import-not-at-top
except ImportError:  # python scripts/<app>.py
  from distloop_cli import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()  # Before TensorFlow is imported.
import os
import shutil

from absl import flags
from absl import logging
try:  # The run's flags: train.py's own.
  from . import train  # pylint: disable=g-import-not-at-top
except ImportError:
  from distloop_cli import train  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
KEPT_DIR = "before_migration"


def _kept(model_dir):
  """The checkpoint a migration of `model_dir` started from, kept, or None."""
  kept = os.path.join(model_dir, KEPT_DIR)
  index = (sorted(f for f in os.listdir(kept) if f.endswith(".index"))
           if os.path.isdir(kept) else [])
  return os.path.join(kept, index[0][:-len(".index")]) if index else None


def _keep(path, model_dir):
  """Copies checkpoint `path` into <model_dir>/before_migration/, whole or
  not at all (a temporary folder renamed); returns the copy's prefix."""
  from framework.errors import ModelDirError  # pylint: disable=g-import-not-at-top
  kept = os.path.join(model_dir, KEPT_DIR)
  partial = kept + ".partial"
  shutil.rmtree(partial, ignore_errors=True)
  folder, name = os.path.split(path)
  try:
    os.makedirs(partial)
    for file in os.listdir(folder):
      if file == name + ".index" or file.startswith(name + ".data-"):
        shutil.copy2(os.path.join(folder, file), partial)
    os.rename(partial, kept)
  except OSError as e:
    shutil.rmtree(partial, ignore_errors=True)
    reason = e.strerror or str(e)
    raise ModelDirError(f"cannot keep checkpoint {path} in {kept} before "
                        f"migrating it ({reason}); {path} is unchanged"
                        ) from None
  return os.path.join(kept, name)


def migrate(config):
  """Migrates `config.model_dir`'s latest checkpoint (see the module);
  returns the checkpoint written, or None when there was nothing to
  migrate."""
  # pylint: disable=g-import-not-at-top
  import tensorflow as tf
  from framework.app import export, factory, resume, run_plan
  from framework.core import checkpoints, protocols
  from framework.core.checkpoints import manager
  from framework.core.checkpoints.run_files import RunLock
  from framework.errors import CheckpointError, ConfigError
  # pylint: enable=g-import-not-at-top
  if not tf.io.gfile.isdir(config.model_dir):
    raise ConfigError(
        f"model_dir={config.model_dir!r} does not exist: give the folder of "
        "the run whose checkpoint to migrate")
  config, strategy = run_plan.place(config)
  with RunLock(config.model_dir):
    plan = run_plan.resolve(config, strategy, placed=True)
    trainer, controller = factory.build(plan)
    path = controller.checkpoints.latest
    kept = _kept(config.model_dir)  # a migration that did not finish
    path = kept or path
    previous = export.read_model_info_quietly(config.model_dir)
    saved = manager.read_run_config(config.model_dir)
    if not path or not resume.saved_before_cross_mesh(
        previous, saved,
        resume.model_fingerprint(protocols.unsplit_model(trainer))):
      logging.warning("model_dir=%s: %s", config.model_dir,
                      f"its checkpoint {path} needs no migration" if path
                      else "it has no checkpoint")
      return None
    was = resume.describe(previous["run_plan"]["model_parallel"])
    now = resume.describe(plan.record()["model_parallel"])
    if was != now:
      raise ConfigError(
          f"checkpoint {path} was saved by split {was}; migrate it with the "
          f"flags of the run that wrote it ({was}), not {now}")
    split_fingerprint = resume.model_fingerprint(trainer.model)
    if saved["model_fingerprint"] != split_fingerprint:
      raise ConfigError(
          f"checkpoint {path} does not match this run's model on split {was} "
          f"(model_fingerprint was {saved['model_fingerprint']}, now "
          f"{split_fingerprint}); use the flags of the run that wrote it")
    # What the run checkpoints, but the split optimizer itself as
    # `optimizer`: its own keys and shapes, as that distloop saved them.
    objects = checkpoints.checkpoint_objects(
        trainer, checkpoints.checkpoint_items(trainer))
    objects["optimizer"] = trainer.optimizer
    problem = manager.damage(path)
    if problem:
      raise CheckpointError(
          f"cannot migrate checkpoint {path}: {problem}"
          + (f" (the copy this script kept before migrating; if the run's "
             f"own {os.path.basename(path)} is intact and not migrated, "
             f"delete {os.path.dirname(path)} and run it again)" if kept else
             " (put back an intact copy of it, e.g. from a backup)"))
    source = kept or _keep(path, config.model_dir)
    try:
      status = tf.train.Checkpoint(**objects).restore(source)
      status.assert_existing_objects_matched()
      status.assert_consumed()
    except (ValueError, AssertionError, tf.errors.OpError) as e:
      raise CheckpointError(
          f"checkpoint {path} does not match split {was}'s model and "
          f"optimizer ({str(e).strip().splitlines()[0][:300]}); use the "
          "flags of the run that wrote it (an optimizer sharded across the "
          "data axis, --shard_optimizer_state, cannot read it)") from None
    # The same step, now as an unsplit run's (run_config.json too).
    written = controller.save(int(trainer.global_step.numpy()))
    logging.warning(
        "migrated checkpoint %s (split %s's own optimizer layout) to %s, "
        "saved as an unsplit run's: it now resumes on any mesh (the "
        "checkpoint as it was: %s)", path, was, written, source)
    return written


def run():
  import framework  # pylint: disable=g-import-not-at-top
  if FLAGS.cpu_devices:
    # Must happen before TensorFlow creates its devices.
    framework.configure_cpu_devices(FLAGS.cpu_devices)
  migrate(train.config_from_flags())


main = cli.main_running(run)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
