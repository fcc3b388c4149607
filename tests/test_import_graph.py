"""The package's layers: no import cycles, and no lower layer imports a
higher one. Every import counts, function-level ones included."""

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first. A module may import its own layer and the ones before it.
LAYERS = ("_tf_internal", "errors", "settings", "distribute", "data", "perf", "core", "model_parallel",
          "tasks", "models", "check", "app")


def _modules():
  """{dotted name: path} of framework/ and models/."""
  found = {}
  for package in ("framework", "models"):
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
      for name in files:
        if not name.endswith(".py"):
          continue
        path = os.path.join(folder, name)
        dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        found[dotted.removesuffix(".__init__")] = path
  return found


def _imports(path, modules):
  """The project modules `path` imports (`from a import b`: a.b if b is a
  module, else a)."""
  result = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [f"{node.module}.{alias.name}" for alias in node.names]
      names = [n if n in modules else node.module for n in names]
    else:
      continue
    result.update(n for n in names if n in modules)
  return result


def _layer(module):
  parts = module.split(".")
  if parts[0] == "models":
    return LAYERS.index("models")
  if len(parts) == 1:
    return len(LAYERS)  # the package's own __init__: above everything
  return LAYERS.index(parts[1])


def _graph():
  modules = _modules()
  return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def test_every_module_belongs_to_a_layer():
  unknown = [m for m in _graph() if m.startswith("framework.")
             and m.split(".")[1] not in LAYERS]
  assert not unknown, f"modules outside the layers {LAYERS}: {unknown}"


def test_no_lower_layer_imports_a_higher_one():
  wrong = [f"{m} ({LAYERS[_layer(m)]}) imports {d} ({LAYERS[_layer(d)]})"
           for m, deps in _graph().items() if m != "framework"
           for d in deps if d != "framework" and _layer(d) > _layer(m)]
  assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
  graph = _graph()
  graph.pop("framework", None)
  state, stack, cycles = {}, [], []

  def visit(node):
    state[node] = "active"
    stack.append(node)
    for dep in sorted(graph.get(node, ())):
      if state.get(dep) == "active":
        cycles.append(stack[stack.index(dep):] + [dep])
      elif dep not in state:
        visit(dep)
    stack.pop()
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node)
  assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_check_sees_a_cycle_and_a_layer_violation(monkeypatch):
  fake = {"framework.core.a": {"framework.app.b"},
          "framework.app.b": {"framework.core.a"}}
  monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: dict(fake))
  for test in (test_no_lower_layer_imports_a_higher_one, test_no_import_cycles):
    try:
      test()
    except AssertionError:
      continue
    raise AssertionError(f"{test.__name__} passed on a broken graph")
