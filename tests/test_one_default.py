"""One default per setting.

Every keyword argument that stands for a setting (a field of a config
dataclass) defaults to that field's default read from the field
(`framework.settings.default`), or has no default; never to a literal
written again. Config dataclasses that share a setting declare it once
(`settings.same_as`), and the apps' flags are made from the fields
(`scripts/config_flags.py`), never written by hand.
"""

import ast
import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap

from absl import flags
import pytest

from framework import settings
from framework.app.config import ExperimentConfig
from framework.core.config import TrainerConfig
from framework.distribute import launcher, netns
from framework.distribute.launch_config import LaunchConfig
from framework.model_parallel.config import ModelParallelConfig
from framework.model_parallel.split_config import SplitConfig
from models.options import ModelOptions
from scripts import config_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _callables():
  """(name, function, config class, {keyword: field} where they differ)."""
  # pylint: disable=g-import-not-at-top
  from framework.core.trainer import Trainer
  from framework.model_parallel import costs, graph, pipeline
  from framework.model_parallel.staged_trainer import StagedTrainer
  from framework.model_parallel.tensor_parallel import TensorParallelTrainer
  from models import cifar_cnn, gpt, mlp, unet
  # pylint: enable=g-import-not-at-top
  cuts = {"boundaries": "stage_boundaries", "balance": "stage_balance"}
  return [
      ("Trainer", Trainer.__init__, TrainerConfig, {}),
      ("StagedTrainer", StagedTrainer.__init__, SplitConfig, {}),
      ("PipelineTrainer", pipeline.PipelineTrainer.__init__, SplitConfig, {}),
      ("TensorParallelTrainer", TensorParallelTrainer.__init__, SplitConfig,
       {}),
      ("split_layers", pipeline.split_layers, SplitConfig, cuts),
      ("split_graph", graph.split_graph, SplitConfig, cuts),
      ("node_costs", costs.node_costs, SplitConfig, cuts),
      ("layer_costs", costs.layer_costs, SplitConfig, cuts),
      ("local_cluster", launcher.local_cluster, LaunchConfig, {}),
      ("cluster_on_hosts", launcher.cluster_on_hosts, LaunchConfig, {}),
      ("free_ports", launcher.free_ports, LaunchConfig, {}),
      ("Launcher", launcher.Launcher.__init__, LaunchConfig, {}),
      ("HostNetwork", netns.HostNetwork.__init__, LaunchConfig,
       {"mtu": "netns_mtu"}),
      ("mlp", mlp.build, ModelOptions, {}),
      ("cifar_cnn", cifar_cnn.build, ModelOptions, {}),
      ("unet", unet.build, ModelOptions, {}),
      ("gpt", gpt.build, ModelOptions, {}),
  ] + _app_callables()


def _app_callables():
  # pylint: disable=g-import-not-at-top
  from framework.app import export, prediction
  from framework.app import prediction as generation
  from framework.app.config import EvalConfig
  from framework.app.config import PredictConfig
  # pylint: enable=g-import-not-at-top
  return [("generate", generation.generate, PredictConfig, {}),
          ("generate_text", generation.generate_text, PredictConfig, {}),
          ("build_inference_model", export.build_inference_model, EvalConfig,
           {}),
          ("check_model_code", export.check_model_code, EvalConfig, {}),
          ("export_saved_model", export.export_saved_model, EvalConfig, {}),
          ("load_model", prediction.load_model, EvalConfig, {})]


def _default_expressions(function):
  """{keyword: the source expression of its default} of `function`."""
  tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
  node = next(n for n in ast.walk(tree)
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
  args = node.args
  positional = args.posonlyargs + args.args
  found = dict(zip([a.arg for a in positional[len(positional)
                                              - len(args.defaults):]],
                   args.defaults))
  found.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults)
                if d is not None})
  return found


def _written_again(expression, field):
  """Why the default `expression` of a keyword for `field` writes the
  default again (None: it reads the field)."""
  constants = [n.value for n in ast.walk(expression)
               if isinstance(n, ast.Constant)]
  if not isinstance(expression, ast.Call) or constants != [field]:
    return f"the literal {ast.unparse(expression)}"
  return None


def _checked():
  rows = []
  for name, function, config, renamed in _callables():
    fields = {f.name for f in dataclasses.fields(config)}
    expressions = _default_expressions(function)
    for keyword, parameter in inspect.signature(function).parameters.items():
      field = renamed.get(keyword, keyword)
      if field in fields:
        rows.append((name, keyword, config, field, parameter,
                     expressions.get(keyword)))
  return rows


@pytest.mark.parametrize("row", _checked(),
                         ids=lambda r: f"{r[0]}.{r[1]}")
def test_each_keyword_reads_its_settings_default(row):
  name, keyword, config, field, parameter, expression = row
  if parameter.default is inspect.Parameter.empty:
    return  # no default of its own
  where = f"{name}({keyword}=...): {config.__name__}.{field}"
  assert expression is not None, where
  problem = _written_again(expression, field)
  assert problem is None, (f"{where} is written again as {problem}; use "
                           f"settings.default({config.__name__}, {field!r})")
  assert parameter.default is settings.default(config, field), where


def test_every_listed_callable_has_a_setting_keyword():
  named = {row[0] for row in _checked()}
  assert named == {c[0] for c in _callables()}


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


def test_the_check_sees_a_literal():
  def written_twice(*, clip_norm=None, nan_policy=settings.default(
      TrainerConfig, "nan_policy")):
    del clip_norm, nan_policy
  expressions = _default_expressions(written_twice)
  assert _written_again(expressions["clip_norm"], "clip_norm")
  assert _written_again(expressions["nan_policy"], "nan_policy") is None


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
  from framework.distribute.choices import EVAL_STRATEGIES, STRATEGIES
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
          "framework.distribute.launch_config\n"
          "assert 'tensorflow' not in sys.modules, 'tensorflow loaded'\n"
          "print(models.model_names())\n"
          "assert 'tensorflow' in sys.modules\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                        capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "['cifar_cnn', 'gpt', 'mlp', 'unet']" in proc.stdout
