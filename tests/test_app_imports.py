"""The command-line apps edit no `sys.path`: the installed package gives them
`framework`, `models` and their siblings (`distloop_cli`), from any folder."""

import ast
import json
import os

import pytest

from helpers import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APPS = ("train", "evaluate", "predict", "launch", "make_tfrecords",
        "migrate_split_checkpoint",
        "plot_curves")


def _sys_path_uses(path):
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  return [node.lineno for node in ast.walk(tree)
          if isinstance(node, ast.Attribute) and node.attr == "path"
          and isinstance(node.value, ast.Name) and node.value.id == "sys"]


def _imports_of_scripts(path):
  """Lines importing the repository's `scripts` package by that name (only
  importable with the repository on sys.path)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  names = [(n.lineno, n.module) for n in ast.walk(tree)
           if isinstance(n, ast.ImportFrom) and n.module and not n.level]
  names += [(n.lineno, a.name) for n in ast.walk(tree)
            if isinstance(n, ast.Import) for a in n.names]
  return [line for line, name in names
          if name == "scripts" or name.startswith("scripts.")]


@pytest.mark.parametrize("app", APPS)
def test_the_app_reads_no_sys_path(app):
  path = os.path.join(ROOT, "scripts", f"{app}.py")
  assert _sys_path_uses(path) == [], f"scripts/{app}.py edits sys.path"


@pytest.mark.parametrize("module", APPS + ("cli", "config_flags", "curves"))
def test_siblings_are_imported_by_the_installed_name(module):
  path = os.path.join(ROOT, "scripts", f"{module}.py")
  assert _imports_of_scripts(path) == [], (
      f"scripts/{module}.py imports scripts.*: use `from . import x` with "
      "`from distloop_cli import x` as the fallback")


@pytest.mark.slow
def test_train_py_by_a_relative_path_from_another_folder(tmp_path):
  # A new interpreter (the zygote has the repository's modules imported),
  # without PYTHONPATH: only the installed package can provide them.
  script = os.path.relpath(os.path.join(ROOT, "scripts", "train.py"), tmp_path)
  proc = run_python(script, "--model=mlp", "--dataset=synthetic",
                    "--train_steps=1", "--global_batch_size=16",
                    "--hidden_units=4", "--noexport_saved_model",
                    "--model_dir=run", cwd=str(tmp_path), fresh=True,
                    env={"PYTHONPATH": None})
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / "run" / "model_info.json") as f:
    assert json.load(f)["run_plan"]["task"] == "classification"
