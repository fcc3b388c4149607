"""docs/reference/api.md shows every public callable, with the signature a
caller sees (`inspect.signature`): no parameter dropped, every public
method of the classes (a custom step's `average`, `apply_gradients`, ...)."""

import importlib
import inspect
import os
import re
import typing

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_MODULES = ("framework", "framework.app.experiment",
               "framework.model_parallel", "models")


def _page():
  with open(os.path.join(ROOT, "docs", "reference", "api.md"),
            encoding="utf-8") as f:
    return f.read()


def _entries(text):
  """{"module.name" or "module.Class.method": signature text}."""
  entries, module, heading, cls = {}, None, None, None
  for block_heading, code in re.findall(
      r"^(#{2,4} .*?)$|^```python\n(.*?)^```", text, re.M | re.S):
    if block_heading.startswith("## "):
      module = block_heading[3:].strip()
    elif block_heading.startswith("### "):
      heading = block_heading.strip("#` ")
      cls = heading
    elif block_heading.startswith("#### "):
      heading = f"{cls}.{block_heading.strip('#` ').split('.', 1)[1]}"
    elif code and heading:
      match = re.match(r"(?:def|class) (\w+)(.*)", code, re.S)
      entries[heading] = match.group(2)
      heading = None
  del module
  return entries


def _also(text):
  """{"module.Class": {method names listed as a base class's}}."""
  result, cls = {}, None
  for line in text.splitlines():
    if line.startswith("### "):
      cls = line.strip("#` ")
    elif line.startswith("Also `"):
      result.setdefault(cls, set()).update(re.findall(r"`(\w+)`,?", line
                                                      .split(":", 1)[1]))
  return result


def _resolve(dotted):
  for split in range(dotted.count("."), 0, -1):
    module_name = dotted.rsplit(".", split)[0]
    if module_name in API_MODULES:
      names = dotted[len(module_name) + 1:].split(".")
      obj = importlib.import_module(module_name)
      owner = None
      for name in names:
        owner, obj = obj, getattr(obj, name)
      return owner, names[-1], obj
  raise AssertionError(f"{dotted}: not in {API_MODULES}")


def _expected(owner, name, obj):
  """The signature a caller sees: a method's without `self`."""
  if (isinstance(obj, type) and issubclass(obj, BaseException) and
      not inspect.isfunction(obj.__init__)):
    return "(*args, **kwargs)"  # inspect finds none for a builtin's
  signature = inspect.signature(obj)
  try:  # Annotations resolved, string forward references included.
    hints = typing.get_type_hints(obj.__init__ if isinstance(obj, type)
                                  else obj)
  except (NameError, TypeError):
    hints = {}

  def resolved(annotation, name):
    # Only the string ones: get_type_hints also spells None as NoneType.
    if annotation == "None":
      return None
    unresolved = isinstance(annotation, str) or "ForwardRef" in repr(
        annotation)
    return hints.get(name, annotation) if unresolved else annotation

  signature = signature.replace(parameters=[
      p.replace(annotation=resolved(p.annotation, p.name))
      for p in signature.parameters.values()])
  if isinstance(obj, type):  # A constructor returns the instance.
    signature = signature.replace(return_annotation=inspect.Signature.empty)
  else:
    signature = signature.replace(return_annotation=resolved(
        signature.return_annotation, "return"))
  if (isinstance(owner, type) and
      inspect.isfunction(inspect.getattr_static(owner, name))):
    signature = signature.replace(
        parameters=list(signature.parameters.values())[1:])
  return str(signature)


def _normal(signature):
  # pdoc's display: no memory addresses, `Callable` for collections.abc's.
  signature = re.sub(r" at 0x[0-9a-f]+", "", signature)
  signature = signature.replace("collections.abc.", "")
  return re.sub(r"\s+|,(?=\s*\))", "", signature)


def _public_methods(cls):
  """Public functions of `cls` defined in this repository's code."""
  for name in dir(cls):
    owner = next((c for c in cls.__mro__ if name in vars(c)), None)
    if (name.startswith("_") or owner is None or
        owner.__module__.split(".")[0] not in ("framework", "models")):
      continue
    if isinstance(vars(owner)[name], (staticmethod, classmethod)) or (
        inspect.isfunction(vars(owner)[name])):
      yield name


def test_every_signature_on_the_page_is_the_callers():
  entries = _entries(_page())
  assert "framework.Trainer.average" in entries
  wrong = []
  for dotted, shown in entries.items():
    expected = _expected(*_resolve(dotted))
    if _normal(shown) != _normal(expected):
      wrong.append(f"{dotted}: page {shown.strip()!r}, code {expected!r}")
  assert not wrong, "\n".join(wrong)


def test_every_public_callable_and_method_has_an_entry():
  text = _page()
  entries, also = _entries(text), _also(text)
  missing = []
  for module_name in API_MODULES:
    module = importlib.import_module(module_name)
    # Without `__all__`, pdoc documents what the module defines.
    names = getattr(module, "__all__", None) or [
        name for name, obj in vars(module).items()
        if not name.startswith("_") and
        getattr(obj, "__module__", None) == module_name]
    for name in names:
      obj = getattr(module, name)
      dotted = f"{module_name}.{name}"
      if not callable(obj):
        continue
      if dotted not in entries:
        missing.append(dotted)
      if not isinstance(obj, type):
        continue
      for method in _public_methods(obj):
        if (f"{dotted}.{method}" not in entries and
            method not in also.get(dotted, ())):
          missing.append(f"{dotted}.{method}")
  assert not missing, missing


@pytest.mark.parametrize("name, first", [
    ("framework.configure_cpu_devices", "num_devices"),
    ("framework.make_strategy", "name"),
    ("framework.masked_sum", "values"),
    ("framework.enable_logging", "level")])
def test_functions_keep_their_first_parameter(name, first):
  assert _normal(_entries(_page())[name]).startswith(f"({first}")
