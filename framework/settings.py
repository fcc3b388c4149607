"""Settings: config dataclass fields that carry their help, flag and checks.

Every setting of a run is written once, as a field of a frozen config
dataclass (`ExperimentConfig`, `OptimizerConfig`, `LoopConfig`, ...):

    learning_rate: float = setting(1e-3, "Peak learning rate.", key=True)

`scripts/config_flags.py` turns each such field into an absl flag (name,
default, type, help and enum choices from here) and builds the config from
the parsed flags; the dataclass's `__post_init__` calls `check_settings`,
so a bad value is one `ConfigError` naming the setting whether it came
from a flag, a flag file or Python. This module imports no TensorFlow:
the flags exist before TensorFlow loads (`--onednn` must be read first).
"""

import dataclasses
import fnmatch
import numbers

from framework.errors import ConfigError, check_choice, check_positive

# What a field's `minimum` may be.
POSITIVE = "positive"  # an integer > 0
NON_NEGATIVE = "non_negative"  # an integer >= 0


def setting(default=dataclasses.MISSING, help="", *, flag=None,  # pylint: disable=redefined-builtin
            choices=None, minimum=None, key=False, zero_unsets=False,
            options=None, free_form=False, read_by=None, parser=None,
            default_factory=dataclasses.MISSING):
  """A dataclass field that is also a command-line flag.

  Args:
    default: the default value (also the flag's).
    help: the flag's help text.
    flag: the flag's name if not the field's; False: the field has no flag
      (filled by the program, e.g. `total_steps`).
    choices: the valid values (an enum flag; checked by `check_settings`).
    minimum: POSITIVE or NON_NEGATIVE (integers; checked by
      `check_settings`).
    key: shown on TensorBoard's HParams dashboard even at its default.
    zero_unsets: the flag value 0 means None (e.g. `--epochs=0` overrides a
      flag file's `--epochs`).
    options: for a dict field: the dataclass whose fields are the flags that
      fill the dict (e.g. the built-in models' options).
    free_form: for a dict field: also a `--<flag>=key=value,...` flag.
    read_by: which choices read the setting, when not every one does:
      {flag of a choosing setting: values (fnmatch patterns) or
      `all_but(values)`}, e.g. `{"dataset": all_but("synthetic")}`; read
      when any named choice matches (see `is_read`). train.py warns about
      a flag that is set but not read by the run's choices.
    parser: for a boolean setting that also takes words: `text -> value`
      (a boolean flag, `--name` and `--noname`, whose `--name=WORD` the
      parser reads; it raises ConfigError on a bad word).
    default_factory: as in `dataclasses.field`.
  """
  metadata = {"help": help, "flag": flag, "choices": choices,
              "minimum": minimum, "key": key, "zero_unsets": zero_unsets,
              "options": options, "free_form": free_form,
              "read_by": read_by, "parser": parser}
  if minimum not in (None, POSITIVE, NON_NEGATIVE):
    raise ValueError(f"minimum={minimum!r} must be None, {POSITIVE!r} or "
                     f"{NON_NEGATIVE!r}")
  return dataclasses.field(default=default, default_factory=default_factory,
                           metadata={"setting": metadata})


def default(cls, name):
  """The default of setting `name` of config dataclass `cls`: what a
  keyword argument standing for that setting defaults to, so that each
  setting has one default (`def f(*, clip_norm=default(TrainerConfig,
  "clip_norm"))`; tests/test_one_default.py scans framework/, models/
  and scripts/ for a default written again).

  Raises:
    ValueError: `cls` has no such field, or it has no default.
  """
  fields = {f.name: f for f in dataclasses.fields(cls)}
  if name not in fields:
    raise ValueError(f"{cls.__name__} has no setting {name!r}")
  if fields[name].default is dataclasses.MISSING:
    raise ValueError(f"{cls.__name__}.{name} has no single default value")
  return fields[name].default


def same_as(cls, name):
  """A field for another config dataclass declaring the setting `name` of
  `cls` again: the same default object, help, flag and checks (e.g.
  `ExperimentConfig.clip_norm` is `TrainerConfig.clip_norm`)."""
  field = {f.name: f for f in dataclasses.fields(cls)}[name]
  return dataclasses.field(default=field.default,
                           default_factory=field.default_factory,
                           metadata=field.metadata)


def info(field):
  """The `setting` metadata of a dataclass field (None for a plain field)."""
  return field.metadata.get("setting")


def flag_name(field):
  """The flag that sets `field` (None if it has none)."""
  meta = info(field)
  if meta is None or meta["flag"] is False:
    return None
  return meta["flag"] or field.name


def check_settings(config):
  """Checks each field of `config` against its choices and minimum.

  Raises:
    ConfigError: naming the setting (as its flag is called), its value and
      what would be valid.
  """
  for field in dataclasses.fields(config):
    meta = info(field)
    if meta is None:
      continue
    name = flag_name(field) or field.name
    value = getattr(config, field.name)
    if meta["choices"] is not None:
      check_choice(name, value, meta["choices"])
    if value is None or meta["minimum"] is None:
      continue
    if meta["minimum"] == POSITIVE:
      check_positive(name, value)
    elif (isinstance(value, bool) or not isinstance(value, numbers.Integral)
          or value < 0):
      raise ConfigError(f"{name}={value!r} must be an integer >= 0")


def _default(field):
  if field.default is not dataclasses.MISSING:
    return field.default
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return dataclasses.MISSING


def hparams(config):
  """{flag name: value} of `config`'s settings that are key or not at their
  default, nested configs and option dicts included: what TensorBoard's
  HParams dashboard shows of a run (a sweep's columns are what changed).

  An option dict's entries without a flag (e.g. `--model_options` of a
  model of one's own) are named `<dict>.<key>`.
  """
  found = {}
  for field in dataclasses.fields(config):
    meta, value = info(field), getattr(config, field.name)
    if meta is None:
      if dataclasses.is_dataclass(value):
        found.update(hparams(value))
      continue
    if meta["options"] is not None:
      fields = {f.name: f for f in dataclasses.fields(meta["options"])}
      for key, item in (value or {}).items():
        option = fields.get(key)
        if option is None:
          found[f"{flag_name(field) or field.name}.{key}"] = item
        elif info(option)["key"] or item != _default(option):
          found[flag_name(option)] = item
      continue
    name = flag_name(field)
    if name is not None and (meta["key"] or value != _default(field)):
      found[name] = value
  return found


@dataclasses.dataclass(frozen=True)
class AllBut:
  """`read_by` values: every value of the choice except these."""
  values: tuple


def all_but(*values):
  """`read_by={"dataset": all_but("synthetic")}`: read by every dataset
  but synthetic."""
  return AllBut(tuple(values))


def _matches(value, patterns):
  return any(fnmatch.fnmatchcase(value, p) for p in patterns)


def is_read(read_by, choices, known=None):
  """Whether a setting declared with `read_by` is read under `choices`
  ({flag: value}, the run's values of the choosing settings).

  `known` ({flag: patterns}) lists the values a choice's table entries
  speak of (the built-in models, the registered datasets); another value
  (a model of one's own) may read anything, so it counts as reading.
  """
  if not read_by:
    return True
  for flag, values in read_by.items():
    value = str(choices[flag])
    if known and flag in known and not _matches(value, known[flag]):
      return True
    if isinstance(values, AllBut):
      if not _matches(value, values.values):
        return True
    elif _matches(value, values):
      return True
  return False
