"""A run resumed on another model split: said in one line, or refused.

A checkpoint holds the unsplit model's weights and optimizer state under
the unsplit model's keys wherever the split keeps them so (a layer-cut
pipeline, a model's whole-model split such as the gpt's: every mesh), so a
run trained on one mesh resumes on another, or on none. The relaunch logs
the change in one line and model_info.json records it under
`config_changes`. The one split whose checkpoint is its own is the tensor
split of one Dense pair (a model without a whole-model split): its shards
sit under their own keys, so it resumes only as itself; any other change
to or from it is one line naming the flag, before anything is restored or
written.
"""

from absl import logging

from framework.errors import ConfigError

# The flags that choose a split, as model_info.json's run_plan records them.
_FLAGS = (("mesh", "mesh"), ("model_parallel", "mode"),
          ("num_shards", "num_shards"), ("num_stages", "num_stages"))


def split_flags(record):
  """{flag: value} of the split a run_plan `model_parallel` record
  describes (only the flags its mode reads)."""
  record = record or {}
  mode = record.get("mode", "none")
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


def check(previous_info, record, *, model, whole_split):
  """Raises ConfigError when the run resumes a checkpoint written under
  another split that cannot restore into this one.

  Args:
    previous_info: the model_dir's model_info.json (None: a new run).
    record: this run's run_plan `model_parallel` record.
    model: the model's name (for the message).
    whole_split: whether the model has a whole-model split (`gpt`).
  """
  was = ((previous_info or {}).get("run_plan") or {}).get("model_parallel")
  if was is None:
    return
  changes = changed_flags(was, record)
  if not changes or not (_own_keys(was, whole_split)
                         or _own_keys(record, whole_split)):
    return
  what = "; ".join(f"{flag} was {_show(old)}, now {_show(new)}"
                   for flag, old, new in changes)
  raise ConfigError(
      f"resuming on another model split is not supported for model={model} "
      f"({what}): its tensor split of one Dense pair checkpoints the shards "
      f"under their own keys; resume with {describe(was)} or use another "
      "model_dir")


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
