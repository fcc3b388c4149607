"""One home per setting: each setting's default is written once.

A setting is a field of a config dataclass declared with
`framework.settings.setting` (or `settings.same_as`, the same declaration
again); its default is written there, once, and read everywhere else
(`settings.default(Config, "name")`). This test does not check a list of
callables: it parses every .py file of framework/, models/ and scripts/
(scripts/benchmarks/ and scripts/examples/ included) and looks at every
place that could write a setting's default again:

  * every keyword default of a function signature or lambda (`seed=0`);
  * every field default in a plain class body (`seed: int = 0`);
  * every absl flag definition (`flags.DEFINE_integer("seed", 0, ...)`);
  * every attribute or key fallback: `getattr(x, "seed", 0)`,
    `d.get("seed", 0)`, `d.pop("seed", 0)`, `d.setdefault("seed", 0)`.

Each place is named for the setting whose field name or flag name it
names (the parameter, flag, attribute or key). It fails when:

  1. its default is a literal equal to the setting's declared default:
     the default written again (read it: `settings.default(...)`);
  2. it is a signature keyword named as a setting with another literal
     default: two concepts share one setting name (rename one);
  3. it reads `settings.default(Config, "other")` under a setting's name:
     the keyword says one setting and defaults to another's.

And the declarations fail when:

  4. two config dataclasses each write a default for one setting name
     (one declares it; another declares it with `settings.same_as`, or
     defaults it to `settings.default(...)`);
  5. two programs hand-write a flag of one name (not a config setting)
     with the same literal default: one setting of both (`--malloc` of
     train.py and of a benchmark that passes it on) written twice; its
     default belongs in one constant both read.

Exclusions, and why:

  * `None`, and a field without a default: "not given", the absence of a
    value, not a value written twice (what None stands for is decided
    once, where it is resolved).
  * A setting whose default is made by a factory (`default_factory=dict`:
    `model_options`, `dataset_options`): `settings.default` cannot hand
    out one shared mutable value, and an empty `{}` fallback is "none
    given", as None is.
  * A default that is not a literal (a name, a call, an attribute): it
    reads a value from somewhere, so it is not the value written again;
    (3) checks the `settings.default` calls.
  * (2) only for signature keywords named as a setting's flag: a field
    whose flag is called otherwise (`OptimizerConfig.name` is
    `--optimizer`, `ModelOptions.width` is `--unet_width`) has a generic
    field name that other code uses for other things (`name=`, `width=`),
    so by its field name it is matched for (1) only.
  * (2) not for flags and key/attribute fallbacks: a program's own flag
    for a run setting may choose another default (a benchmark's
    `--global_batch_size=256`), and a dict key is named by whatever wrote
    the dict (a mesh's `{"model": 2}` axis sizes); neither may write the
    setting's own default again (1).
  * (5) not for the defaults that say "off" or "none" (False, "", [],
    None): a switch or an empty list is off by default in every program.
  * Private helpers are not excluded: `_f(seed=0)` writes the default
    again as much as `f(seed=0)` does.
"""

import ast
import dataclasses
import importlib
import os
import subprocess
import sys

from absl import flags
import pytest

from framework import settings
from framework.app.config import ExperimentConfig
from framework.core.config import TrainerConfig
from framework.distribute.config import LaunchConfig
from framework.model_parallel.config import ModelParallelConfig
from framework.model_parallel.config import SplitConfig
from models.options import ModelOptions
from scripts import config_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("framework", "models", "scripts")

def _files():
  """The .py files scanned, relative to ROOT, in a stable order."""
  found = []
  for top in SCANNED:
    for folder, subfolders, names in os.walk(os.path.join(ROOT, top)):
      subfolders[:] = sorted(d for d in subfolders
                             if not d.startswith((".", "__pycache__")))
      found += [os.path.relpath(os.path.join(folder, n), ROOT)
                for n in sorted(names) if n.endswith(".py")]
  return found


def _parse(path):
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    return ast.parse(f.read(), filename=path)


def _called(call):
  """The name a call calls (`f` of `f(...)` and of `x.f(...)`)."""
  function = call.func
  if isinstance(function, ast.Name):
    return function.id
  if isinstance(function, ast.Attribute):
    return function.attr
  return None


def _declares_settings(node):
  """Whether class `node` has fields declared with setting/same_as."""
  return isinstance(node, ast.ClassDef) and any(
      isinstance(s, ast.AnnAssign) and isinstance(s.value, ast.Call)
      and _called(s.value) in ("setting", "same_as") for s in node.body)


@dataclasses.dataclass(frozen=True)
class Declaration:
  """One setting field of a config dataclass."""
  path: str
  line: int
  config: str
  field: str
  flag: str | None
  default: object  # dataclasses.MISSING: none, or made by a factory
  home: bool  # writes its default here (not same_as / settings.default)


def _declared_default_expression(value):
  """The expression a `setting(...)` call gives as default (None: none)."""
  if value.args:
    return value.args[0]
  return next((k.value for k in value.keywords if k.arg == "default"), None)


def _declarations(path, tree):
  found = []
  for node in ast.walk(tree):
    if not _declares_settings(node):
      continue
    module = importlib.import_module(path[:-len(".py")].replace("/", "."))
    config = getattr(module, node.name)
    lines = {s.target.id: s for s in node.body if isinstance(s, ast.AnnAssign)
             and isinstance(s.target, ast.Name)}
    for field in dataclasses.fields(config):
      if settings.info(field) is None:
        continue
      statement = lines[field.name]
      expression = (_declared_default_expression(statement.value)
                    if _called(statement.value) == "setting" else None)
      home = expression is not None and _literal(expression)[0]
      found.append(Declaration(path, statement.lineno, node.name, field.name,
                               settings.flag_name(field),
                               field.default,
                               home))
  return found


def _literal(node):
  """(True, value) when `node` is a literal, else (False, None)."""
  try:
    return True, ast.literal_eval(node)
  except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
    return False, None


def _equal(a, b):
  """Whether two defaults are the same value (True is not 1; a flag's
  list of strings equals a tuple of the values they spell)."""
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(
        _equal(x, y) or str(x) == str(y) for x, y in zip(a, b))
  if isinstance(a, bool) or isinstance(b, bool):
    return type(a) is type(b) and a == b
  if isinstance(a, (int, float)) and isinstance(b, (int, float)):
    return a == b
  return type(a) is type(b) and a == b


@dataclasses.dataclass(frozen=True)
class Place:
  """A default written for a name: a keyword, field, flag or fallback."""
  path: str
  line: int
  kind: str  # "keyword", "field", "flag" or "fallback"
  name: str
  expression: ast.AST

  def __str__(self):
    return (f"{self.path}:{self.line}: {self.kind} {self.name}="
            f"{ast.unparse(self.expression)}")


def _places(path, tree):
  """Every default written for a name in `tree`."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      args = node.args
      positional = args.posonlyargs + args.args
      pairs = list(zip(positional[len(positional) - len(args.defaults):],
                       args.defaults))
      pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)
                if d is not None]
      found += [Place(path, d.lineno, "keyword", a.arg, d) for a, d in pairs]
    elif isinstance(node, ast.ClassDef) and not _declares_settings(node):
      found += [Place(path, s.lineno, "field", s.target.id, s.value)
                for s in node.body if isinstance(s, ast.AnnAssign)
                and isinstance(s.target, ast.Name) and s.value is not None]
    elif isinstance(node, ast.Call):
      found += _call_places(path, node)
  return found


def _call_places(path, call):
  called = _called(call)
  named = (call.args and isinstance(call.args[0], ast.Constant)
           and isinstance(call.args[0].value, str))
  if called and called.startswith("DEFINE") and named:
    default = (call.args[1] if len(call.args) > 1 else next(
        (k.value for k in call.keywords if k.arg == "default"), None))
    if default is not None:
      return [Place(path, call.lineno, "flag", call.args[0].value, default)]
  if (called == "getattr" and len(call.args) == 3
      and isinstance(call.args[1], ast.Constant)
      and isinstance(call.args[1].value, str)):
    return [Place(path, call.lineno, "fallback", call.args[1].value,
                  call.args[2])]
  if (called in ("get", "pop", "setdefault") and named
      and isinstance(call.func, ast.Attribute) and len(call.args) == 2):
    return [Place(path, call.lineno, "fallback", call.args[0].value,
                  call.args[1])]
  return []


def _scan():
  """(declarations, places) of every scanned file."""
  declarations, places = [], []
  for path in _files():
    tree = _parse(path)
    declarations += _declarations(path, tree)
    places += _places(path, tree)
  return declarations, places


_SCAN = []


def _scanned():
  if not _SCAN:
    _SCAN.append(_scan())
  return _SCAN[0]


def _by_name(declarations):
  """{setting name: its declarations}; a field is named by its field name
  and its flag name."""
  named = {}
  for d in declarations:
    for name in {d.field, d.flag} - {None}:
      named.setdefault(name, []).append(d)
  return named


def _has_value(value):
  return value is not None and value is not dataclasses.MISSING


def _default_call(expression):
  """(config name, field) of a `settings.default(Config, "field")`."""
  if (isinstance(expression, ast.Call) and _called(expression) == "default"
      and len(expression.args) == 2
      and isinstance(expression.args[1], ast.Constant)):
    return ast.unparse(expression.args[0]), expression.args[1].value
  return None


def problems(declarations, places):
  """[(path, setting, what is wrong)] of the scan."""
  found = []
  named = _by_name(declarations)
  for place in places:
    if place.name not in named:
      continue
    defaults = [d.default for d in named[place.name] if _has_value(d.default)]
    read = _default_call(place.expression)
    if read is not None:
      fields = {d.field for d in named[place.name]}
      if place.kind == "keyword" and read[1] not in fields:
        found.append((place.path, place.name,
                      f"{place} reads another setting's default"))
      continue
    is_literal, value = _literal(place.expression)
    if not is_literal or value is None:
      continue
    if any(_equal(value, d) for d in defaults):
      found.append((place.path, place.name,
                    f"{place} writes the default of setting {place.name} "
                    f"again; read it with settings.default"))
    elif place.kind == "keyword" and any(
        d.flag == place.name for d in named[place.name]):
      found.append((place.path, place.name,
                    f"{place}: another concept under the name of setting "
                    f"{place.name} (default {defaults}); rename one"))
  found += _flags_written_twice(named, places)
  for name, where in sorted(_by_name(declarations).items()):
    homes = [d for d in where if d.home and _has_value(d.default)]
    homes = list({(d.path, d.config, d.field): d for d in homes}.values())
    if len(homes) < 2:
      continue
    found += [(d.path, name,
               f"{d.path}:{d.line}: {d.config}.{d.field} writes the "
               f"default of setting {name} again (also: "
               f"{', '.join(h.config for h in homes if h is not d)})")
              for d in homes]
  return found


def _flags_written_twice(named, places):
  """(5): hand-written flags of one name and default in several files."""
  flags_by_default = {}
  for place in places:
    is_literal, value = _literal(place.expression)
    if (place.kind != "flag" or place.name in named or not is_literal
        or value in (None, False, "") or value == [] or value == ()):
      continue
    key = (place.name, repr(tuple(value) if isinstance(value, list)
                            else value))
    flags_by_default.setdefault(key, []).append(place)
  found = []
  for (name, _), where in sorted(flags_by_default.items()):
    if len({p.path for p in where}) > 1:
      found += [(p.path, name, f"{p}: the flag --{name} of "
                 f"{', '.join(q.path for q in where if q.path != p.path)} "
                 "written again; read its default from one constant")
                for p in where]
  return found


def test_every_setting_default_is_written_once():
  wrong = problems(*_scanned())
  assert not wrong, "\n".join(sorted({p[2] for p in wrong}))


def test_the_scan_finds_every_kind_of_place():
  code = '''
flags.DEFINE_integer("seed", 0, "")
flags.DEFINE_integer("global_batch_size", 7, "")
def f(x, seed=0, *, clip_norm=None, recompute=False, num_stages=1,
      num_shards=settings.default(SplitConfig, "num_stages"),
      grad_accum_steps=settings.default(TrainerConfig, "grad_accum_steps")):
  return getattr(x, "eval_tta", "none"), x.get("input_mode", "global")
g = lambda image_size=128: image_size
@dataclasses.dataclass
class Plain:
  nan_policy: str = "stop"
'''
  declarations, _ = _scanned()
  places = _places("example.py", ast.parse(code)) + _places(
      "other.py", ast.parse('flags.DEFINE_string("cores", "0,1", "")\n'
                            'flags.DEFINE_bool("quick", False, "")')) + (
                                _places("another.py", ast.parse(
                                    'flags.DEFINE_string("cores", "0,1", "")'
                                    '\nflags.DEFINE_bool("quick", False, "")'
                                )))
  found = sorted((p[1], p[2].split(": ")[1].split(" ")[0])
                 for p in problems(declarations, places)
                 if p[0] in ("example.py", "other.py", "another.py"))
  assert found == [
      ("cores", "flag"), ("cores", "flag"), ("eval_tta", "fallback"), ("image_size", "keyword"),
      ("input_mode", "fallback"), ("nan_policy", "field"),
      ("num_shards", "keyword"), ("num_stages", "keyword"),
      ("recompute", "keyword"), ("seed", "flag"), ("seed", "keyword")], found


def test_the_scan_sees_a_setting_declared_twice():
  declarations, _ = _scanned()
  twice = [d for d in declarations if d.field == "num_shards" and d.home][0]
  again = dataclasses.replace(twice, path="example.py", config="Other")
  assert [p[:2] for p in problems([twice, again], [])] == [
      (twice.path, "num_shards"), ("example.py", "num_shards")]


def _shared():
  # pylint: disable=g-import-not-at-top
  from framework.app.config import EvalConfig
  from framework.app.config import PredictConfig
  # pylint: enable=g-import-not-at-top
  return [(ExperimentConfig, TrainerConfig, None),
          (ModelParallelConfig, SplitConfig, None),
          (PredictConfig, EvalConfig, ("trust_model_code",))]


@pytest.mark.parametrize("outer, inner, names", _shared())
def test_configs_declare_a_shared_setting_once(outer, inner, names):
  outer_fields = {f.name: f for f in dataclasses.fields(outer)}
  for field in dataclasses.fields(inner):
    if names is not None and field.name not in names:
      continue
    copy = outer_fields[field.name]
    assert copy.default is field.default, field.name
    # The same declaration (settings.same_as), not one written again.
    assert copy.metadata.get("setting") is field.metadata.get("setting"), (
        f"{outer.__name__}.{field.name} declares {inner.__name__}."
        f"{field.name} again; use settings.same_as")


# The apps and the config each makes its flags from.
APPS = {"train": "ExperimentConfig", "evaluate": "EvalConfig",
        "predict": "PredictConfig", "launch": "LaunchConfig"}


def _app_config(name):
  # pylint: disable=g-import-not-at-top
  from framework.app.config import EvalConfig
  from framework.app.config import PredictConfig
  # pylint: enable=g-import-not-at-top
  return {"ExperimentConfig": ExperimentConfig, "EvalConfig": EvalConfig,
          "PredictConfig": PredictConfig,
          "LaunchConfig": LaunchConfig}[APPS[name]]


def _app_tree(app):
  path = os.path.join(ROOT, "scripts", f"{app}.py")
  with open(path, encoding="utf-8") as f:
    return ast.parse(f.read())


def _calls(tree, attribute):
  return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
          and isinstance(n.func, ast.Attribute) and n.func.attr == attribute]


@pytest.mark.parametrize("app", sorted(APPS))
def test_an_apps_setting_flags_are_made_from_its_config(app):
  tree = _app_tree(app)
  made = _calls(tree, "define_flags")
  assert len(made) == 1, f"{app}.py: one config_flags.define_flags call"
  named = {k.arg: ast.unparse(k.value) for k in made[0].keywords}
  assert named.get("cls", "ExperimentConfig") == APPS[app], named
  setting_flags = {f.name for f in config_flags.walk(_app_config(app))}
  hand_written = [
      c.args[0].value for c in ast.walk(tree) if isinstance(c, ast.Call)
      and isinstance(c.func, ast.Attribute)
      and c.func.attr.startswith("DEFINE_") and c.args
      and isinstance(c.args[0], ast.Constant)]
  twice = sorted(set(hand_written) & setting_flags)
  assert not twice, (f"{app}.py writes the flags of settings again: {twice}; "
                     f"they are {APPS[app]} fields")


@pytest.mark.parametrize("app", sorted(APPS))
def test_each_generated_flag_has_its_fields_default(app):
  cls = _app_config(app)
  values = flags.FlagValues()
  config_flags.define_flags(values, cls=cls)
  for flag in config_flags.walk(cls):
    if flag.kind is dict:
      continue
    default = flag.field.default
    if default is dataclasses.MISSING:
      assert values[flag.name].default is None
      continue
    if flag.kind is tuple:
      default = [str(v) for v in default]
    assert values[flag.name].default == default, flag.name


def test_evaluate_takes_the_strategies_of_the_one_list():
  # pylint: disable=g-import-not-at-top
  from framework.app.config import EvalConfig
  from framework.distribute.config import EVAL_STRATEGIES, STRATEGIES
  # pylint: enable=g-import-not-at-top
  values = flags.FlagValues()
  config_flags.define_flags(values, cls=EvalConfig)
  assert values["strategy"].parser.enum_values == list(EVAL_STRATEGIES)
  assert set(STRATEGIES) - set(EVAL_STRATEGIES) == {"parameter_server"}



@pytest.mark.slow
def test_the_settings_load_no_tensorflow():
  # A fresh interpreter (a forked run has TensorFlow imported already): the
  # flags are made from these before TensorFlow loads (--onednn).
  code = ("import sys, models, models.options, scripts.config_flags, "
          "framework.app.config, framework.app.config, "
          "framework.distribute.config\n"
          "assert 'tensorflow' not in sys.modules, 'tensorflow loaded'\n"
          "print(models.model_names())\n"
          "assert 'tensorflow' in sys.modules\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                        capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "['cifar_cnn', 'gpt', 'mlp', 'unet']" in proc.stdout
