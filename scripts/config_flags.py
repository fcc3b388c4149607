"""The apps' flags, made from the config dataclasses.

Every field declared with `framework.settings.setting` in `ExperimentConfig`
and the configs it nests (`OptimizerConfig`, `LoopConfig`,
`ModelParallelConfig`, and the dicts' `ModelOptions` and `DatasetOptions`)
is one absl flag: its name (the field's, or the `flag=` it declares), type,
default, help and enum choices come from the field. `config_from_flags`
builds the `ExperimentConfig` from the parsed flags; the dataclasses check
the values (one `ConfigError` naming the flag). Nothing here repeats a
default, a help text or a check. `evaluate.py` (`EvalConfig`), `predict.py`
(`PredictConfig`) and `launch.py` (`LaunchConfig`) make theirs the same way
(`define_flags(cls=...)`, `build_config`).
"""

import dataclasses
import types
import typing

from absl import flags

from framework import settings
from framework.app.config import BUILTIN_MODELS, ExperimentConfig
from framework.data.config import DATASET_NAMES
from framework.errors import ConfigError
from framework.model_parallel.config import parse_mesh

# Fields without a flag that the flags' config must still fill: the run's
# length, replaced by factory.build_model_and_optimizer.
_FILLED_LATER = {("loop", "train_steps"): 1}


@dataclasses.dataclass(frozen=True)
class Flag:
  """One setting's flag: where its value goes and how it is parsed."""
  name: str
  path: tuple  # field names from ExperimentConfig down to the field
  field: dataclasses.Field
  kind: type  # bool, int, float, str, tuple (list flag) or dict (free form)
  item: object = None  # the element type of a list flag (int, str, int|str)

  @property
  def meta(self):
    return settings.info(self.field)


def _unwrap(hint):
  """`X` for `X | None`."""
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1:
      return args[0]
  return hint


def _nested(hint):
  hint = _unwrap(hint)
  return hint if dataclasses.is_dataclass(hint) else None


def walk(cls=ExperimentConfig, path=()):
  """The `Flag`s of `cls` and of the configs it nests, in field order."""
  hints = typing.get_type_hints(cls)
  for field in dataclasses.fields(cls):
    meta = settings.info(field)
    hint = _unwrap(hints[field.name])
    here = path + (field.name,)
    if meta is None:
      if _nested(hint):
        yield from walk(_nested(hint), here)
      continue
    if meta["options"] is not None:
      yield from walk(meta["options"], here)
      if meta["free_form"]:
        yield Flag(settings.flag_name(field), here, field, dict)
      continue
    name = settings.flag_name(field)
    if name is None:
      continue
    if typing.get_origin(hint) is tuple:
      yield Flag(name, here, field, tuple, typing.get_args(hint)[0])
    else:
      yield Flag(name, here, field, hint)


class _WordsParser(flags.BooleanParser):
  """A boolean flag's parser that also takes its setting's words
  (`setting(parser=...)`): `--recompute`, `--norecompute`,
  `--recompute=true|false` as before, `--recompute=blocks` too."""

  def __init__(self, parse_value):
    super().__init__()
    self.parse_value = parse_value

  def parse(self, argument):
    try:
      return self.parse_value(argument)
    except ConfigError as e:
      raise ValueError(str(e)) from None


class _WordsFlag(flags.Flag):
  """Serializes a word as `--name=word` (a boolean as `--name`/`--noname`)."""

  def _serialize(self, value):
    if isinstance(value, str):
      return f"--{self.name}={value}"
    return super()._serialize(value)


def define_flags(flag_values=flags.FLAGS, cls=ExperimentConfig):
  """Defines one flag per setting of `cls` (and the configs it nests);
  returns their names. A setting without a default is a required flag."""
  names = []
  for flag in walk(cls):
    meta, default = flag.meta, flag.field.default
    required = default is dataclasses.MISSING and (
        flag.field.default_factory is dataclasses.MISSING)
    if required:
      default = None
    args = dict(flag_values=flag_values)
    if flag.kind is dict:
      flags.DEFINE_string(flag.name, "", meta["help"], **args)
    elif flag.kind is tuple:
      flags.DEFINE_list(flag.name, [str(v) for v in default], meta["help"],
                        **args)
    elif meta["parser"] is not None:
      flags.DEFINE_flag(_WordsFlag(_WordsParser(meta["parser"]),
                                   flags.ArgumentSerializer(), flag.name,
                                   default, meta["help"], boolean=True),
                        flag_values)
    elif meta["choices"] is not None:
      flags.DEFINE_enum(flag.name, default, list(meta["choices"]),
                        meta["help"], **args)
    elif flag.kind is bool:
      flags.DEFINE_bool(flag.name, default, meta["help"], **args)
    elif flag.kind is int:
      flags.DEFINE_integer(flag.name, default, meta["help"], **args)
    elif flag.kind is float:
      flags.DEFINE_float(flag.name, default, meta["help"], **args)
    elif flag.kind is str:
      flags.DEFINE_string(flag.name, default, meta["help"], **args)
    else:
      raise TypeError(f"setting {'.'.join(flag.path)}: no flag type for "
                      f"{flag.kind!r}")
    if required:
      flags.mark_flag_as_required(flag.name, flag_values=flag_values)
    names.append(flag.name)
  return names


def build_config(cls, flag_values=flags.FLAGS, **replaced):
  """The `cls` (a config without option dicts, e.g. `EvalConfig`) that the
  parsed flags `define_flags(cls=cls)` made describe; `replaced` fields
  take the values the app decided (e.g. a resolved checkpoint)."""
  values = {flag.path: _value(flag, flag_values[flag.name].value)
            for flag in walk(cls)}
  values.update({(name,): value for name, value in replaced.items()})
  return _build(cls, (), values)


def _item(flag, text):
  if flag.item is str:
    return text
  if flag.item is int:
    return int(text)
  # int | str (e.g. stage boundaries: layer indices or names).
  return int(text) if text.lstrip("-").isdigit() else text


def _value(flag, value):
  """The field value of `flag`'s parsed flag value."""
  if flag.kind is tuple:
    try:
      return tuple(_item(flag, v) for v in value)
    except ValueError:
      raise ConfigError(f"{flag.name}={','.join(value)!r} must be "
                        "integers separated by commas") from None
  if flag.meta["zero_unsets"] and value == 0:
    return None
  return value


def _build(cls, path, values):
  """`cls` from `values` {path: field value} (nested configs built too)."""
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for field in dataclasses.fields(cls):
    here = path + (field.name,)
    if here in values:
      kwargs[field.name] = values[here]
    elif settings.info(field) is None and _nested(hints[field.name]):
      kwargs[field.name] = _build(_nested(hints[field.name]), here, values)
    elif here in _FILLED_LATER:
      kwargs[field.name] = _FILLED_LATER[here]
  return cls(**kwargs)


def config_from_flags(flag_values=flags.FLAGS, hparam_flags=()):
  """The ExperimentConfig the parsed flags describe.

  Args:
    hparam_flags: more flag names (the program's own, e.g. --cpu_devices)
      that `ExperimentConfig.hparams` may record.
  """
  all_flags = list(walk())
  values = {flag.path: _value(flag, flag_values[flag.name].value)
            for flag in all_flags if flag.kind is not dict}
  # The option dicts: their dataclass (which checks them), then the
  # free-form --model_options over it.
  for field in dataclasses.fields(ExperimentConfig):
    meta = settings.info(field)
    if meta is None or meta["options"] is None:
      continue
    built = meta["options"](**{
        name: values.pop((field.name, name)) for name in
        [f.name for f in dataclasses.fields(meta["options"])]
        if (field.name, name) in values})
    if field.name == "dataset_options":  # only what the dataset's loader takes
      values[(field.name,)] = built.for_dataset(values[("dataset",)])
    elif values[("model",)] in BUILTIN_MODELS:
      values[(field.name,)] = dataclasses.asdict(built)
    else:
      # A model of one's own keeps its own defaults: only the options the
      # command line (or a flag file) set reach it.
      given = [f for f in all_flags if f.path[:-1] == (field.name,)
               and flag_values[f.name].present]
      values[(field.name,)] = {f.path[-1]: getattr(built, f.path[-1])
                               for f in given}
      if given:
        import models  # pylint: disable=g-import-not-at-top
        models.registry.check_flag_options(
            values[("model",)], values[(field.name,)],
            {f.path[-1]: f.name for f in given})
  for flag in all_flags:
    text = flag_values[flag.name].value
    if flag.kind is dict and text:
      import models  # pylint: disable=g-import-not-at-top
      values[flag.path] = dict(values[flag.path], **models.registry.
                               parse_options(values[("model",)], text))
  config = _build(ExperimentConfig, (), values)
  # The program's own flags (e.g. --cpu_devices) where they were changed.
  own = {name: flag_values[name].value for name in hparam_flags
         if name not in {f.name for f in all_flags}
         and flag_values[name].value != flag_values[name].default}
  return dataclasses.replace(config,
                             hparams=dict(settings.hparams(config), **own))


def key_flags():
  """The flags TensorBoard's HParams dashboard always shows."""
  return [f.name for f in walk() if f.meta["key"]]


# The values of the open-ended choices that `read_by` tables speak of: a
# model or dataset of one's own may read any option.
KNOWN_CHOICES = {"model": BUILTIN_MODELS, "dataset": DATASET_NAMES}


def read_by_table(extra=None, cls=ExperimentConfig):
  """{flag: read_by} of every setting of `cls` that only some choices read
  (its `setting(read_by=...)`), and `extra`: the app's own flags' entries."""
  table = {f.name: f.meta["read_by"] for f in walk(cls)
           if f.meta["read_by"]}
  table.update(extra or {})
  return table


def _set_in(args, flag_values):
  """[(flag, value text)] that the command-line words `args` set, in order
  (a `--flagfile` word itself excluded)."""
  found, words = [], list(args)
  while words:
    word = words.pop(0)
    if word == "--":
      break
    if not word.startswith("-"):
      continue
    name, has_value, value = word.lstrip("-").partition("=")
    if name == "flagfile":
      if not has_value and words:
        words.pop(0)
      continue
    if name not in flag_values and name.startswith("no") and (
        name[2:] in flag_values) and not has_value:
      found.append((name[2:], "false"))
      continue
    if name not in flag_values:
      continue
    if not has_value:
      if flag_values[name].boolean:
        value = "true"
      elif words:
        value = words.pop(0)
    if flag_values[name].boolean:
      value = value.lower()
    found.append((name, value))
  return found


def _text(flag):
  """A flag's value as `read_by` patterns name it ("true"/"false" for a
  boolean)."""
  if flag.boolean:
    return "true" if flag.value else "false"
  return str(flag.value)


def _flag_files(args):
  """The `--flagfile` paths among the command-line words `args`."""
  paths, words = [], list(args)
  while words:
    word = words.pop(0)
    if word == "--":
      break
    if word.lstrip("-") == "flagfile" and words:
      paths.append(words.pop(0))
    elif word.lstrip("-").startswith("flagfile="):
      paths.append(word.split("=", 1)[1])
  return paths


def unread_flags(argv, flag_values=flags.FLAGS, extra=None, table=None):
  """[(flag, {choosing flag: value})]: the flags that `argv` sets but the
  run's choices (its --model, --dataset, --strategy, ...) do not read.

  `table` ({flag: read_by}) replaces train.py's (`read_by_table(extra)`),
  for an app with flags of its own only.

  A flag that only a flag file sets is also fine when that file's own
  choices read it (a recipe's `--hidden_units` when the command line picks
  another `--model`): only what the command line itself sets is held
  against the final choices alone.
  """
  table = read_by_table(extra) if table is None else table
  choosing = sorted({c for read_by in table.values() for c in read_by})
  final = {c: _text(flag_values[c]) for c in choosing}
  _mesh_mode(final, flag_values)
  direct = {name for name, _ in _set_in(argv[1:], flag_values)}
  contexts = {}  # flag set only by flag files -> their choices
  for path in _flag_files(argv[1:]):
    try:
      words = flag_values.read_flags_from_files([f"--flagfile={path}"],
                                                force_gnu=False)
    except flags.Error:
      continue  # absl reported it already
    pairs = _set_in(words, flag_values)
    own = dict(final, **{n: v for n, v in pairs if n in final})
    for name, _ in pairs:
      if name not in direct:
        contexts[name] = own
  unread = []
  for name in [n for n in table if n in direct or n in contexts]:
    read_by = table[name]
    if settings.is_read(read_by, final, KNOWN_CHOICES):
      continue
    if name in contexts and settings.is_read(read_by, contexts[name],
                                             KNOWN_CHOICES):
      continue
    unread.append((name, {c: final[c] for c in read_by}))
  return unread


def _mesh_mode(final, flag_values):
  """A `--mesh` chooses the split as --model_parallel does (its flags, e.g.
  --model_parallel_devices, are then read)."""
  if final.get("model_parallel") != "none" or "mesh" not in flag_values:
    return
  try:
    sizes = parse_mesh(flag_values["mesh"].value or "")
  except ConfigError:
    return  # no mesh, or a bad one: the run says why
  final["model_parallel"] = ("tensor" if sizes.get("model", 1) > 1
                             else "pipeline")


def unread_warning(argv, flag_values=flags.FLAGS, extra=None, table=None):
  """The text of the one warning line about `unread_flags` (None: none)."""
  unread = unread_flags(argv, flag_values, extra, table)
  if not unread:
    return None
  return "; ".join(
      f"--{name} is not read by " + ", ".join(
          f"--{c}={v}" for c, v in by.items())
      for name, by in unread) + (
          "; it has no effect in this run" if len(unread) == 1 else
          "; they have no effect in this run")
