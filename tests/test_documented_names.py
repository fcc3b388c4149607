"""Every `framework.X.Y` name the guide shows resolves after `import framework`
alone: the subpackages load their modules on first use."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

import helpers

_NAME = re.compile(r"(?<![\w/.])framework(?:\.\w+)+")


def _documented_names():
  """{dotted name: guide page} from python blocks and inline code."""
  names = {}
  for path in sorted(glob.glob(os.path.join(helpers.ROOT, "docs", "guide",
                                            "*.md"))):
    text = open(path).read()
    code = re.findall(r"```python\n(.*?)```", text, re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text,
                                              flags=re.S))
    for snippet in code + inline:
      for name in _NAME.findall(snippet):
        names.setdefault(name, os.path.basename(path))
  return names


def test_the_guide_names_framework_modules_at_all():
  names = _documented_names()
  assert "framework.app.experiment.run" in names
  assert len([n for n in names if n.count(".") >= 2]) >= 20


@pytest.mark.slow
def test_every_documented_dotted_name_resolves_after_import_framework():
  # A fresh interpreter: a forked one has the modules imported already,
  # which sets the attributes this checks.
  names = sorted(_documented_names())
  code = ("import functools, json, sys\nimport framework\n"
          "bad = []\n"
          "for name in json.loads(sys.argv[1]):\n"
          "  try:\n"
          "    functools.reduce(getattr, name.split('.')[1:], framework)\n"
          "  except AttributeError as e:\n"
          "    bad.append(f'{name}: {e}')\n"
          "print(json.dumps(bad))\n")
  proc = subprocess.run([sys.executable, "-c", code, json.dumps(names)],
                        cwd=helpers.ROOT, capture_output=True, text=True,
                        timeout=300, check=False,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  bad = json.loads(proc.stdout.splitlines()[-1])
  pages = _documented_names()
  assert not bad, [f"{pages[b.split(':')[0]]}: {b}" for b in bad]
