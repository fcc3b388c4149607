"""The configuration check of a resume, in the layer a Controller-only user
reaches (`checkpoints.for_loop(..., run_config=..., allow_config_change=)`).

`compare(path, saved, current, allow_config_change=)` is pure: what
changed between the `run_config.json` the checkpoints were written with
and this run's, a CheckpointError when it may not, or a warning when it is
allowed. `CheckpointManager.restore_latest` calls it after the restore;
what goes into a run's `run_config` is decided above
(`framework.app.resume.run_config`).
"""

import json

from absl import logging

from framework.errors import CheckpointError


def _describe(value):
  return json.dumps(value, sort_keys=True)


def compare(path, saved, current, *, allow_config_change):
  """[(key, old, new)] of the changes an allowed resume of `path` makes
  ([] if none, or nothing to compare); CheckpointError if not allowed.

  Args:
    path: the restored checkpoint (for the message).
    saved: the checkpoints' run_config.json (None: not compared).
    current: this run's run_config (None: not compared).
    allow_config_change: a change is a warning, not an error.
  """
  if current is None or saved is None:
    return []
  current = json.loads(json.dumps(current))
  # A key the checkpoints' run_config.json lacks (written by an older
  # version) is not a change.
  changes = [(k, saved.get(k), current.get(k))
             for k in sorted(set(saved) | set(current))
             if k in saved and saved.get(k) != current.get(k)]
  if not changes:
    return []
  what = "; ".join(f"{k} was {_describe(old)}, now {_describe(new)}"
                   for k, old, new in changes)
  if any(k == "model_fingerprint" for k, _, _ in changes):
    what += (" (the model's layers differ from the checkpoint's, e.g. "
             "other activations: the model's code changed)")
  if allow_config_change:
    logging.warning("Resuming %s with a changed configuration (allowed): "
                    "%s", path, what)
    return changes
  raise CheckpointError(
      f"checkpoint {path} was written with another configuration: {what}; "
      "use the same flags, another model_dir, or allow_config_change to "
      "resume anyway (e.g. fine-tuning)")
