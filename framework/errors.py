"""Errors that the scripts turn into one clear line and a non-zero exit."""


class DistloopError(Exception):
  """Base class: a problem the user can fix, reported without a traceback."""


class ConfigError(DistloopError, ValueError):
  """An argument, flag or environment variable (TF_CONFIG) has a bad value."""


class DataError(DistloopError):
  """A dataset directory or file is missing or malformed."""


class CheckpointError(DistloopError):
  """A checkpoint cannot be restored into this model, or its state is corrupt."""


class ModelDirError(DistloopError):
  """model_dir cannot be written: in use by another run, read-only or full."""


class ClusterError(DistloopError):
  """A task of a multi-process job died or cannot be reached."""


class NonFiniteLossError(DistloopError):
  """Training produced a NaN or Inf loss (see `nan_policy`)."""


def first_line(error):
  """The first line of `error`'s message (its type's name if it has none)."""
  text = str(error).strip().splitlines()
  return text[0] if text else type(error).__name__


def check_positive(name, value):
  """Raises ConfigError unless `value` is a positive integer."""
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ConfigError(f"{name}={value!r} must be a positive integer")
  return value


def check_choice(name, value, choices):
  """Raises ConfigError unless `value` is one of `choices`."""
  if value not in choices:
    raise ConfigError(
        f"{name}={value!r} is not valid; choose one of: {', '.join(choices)}")
  return value
