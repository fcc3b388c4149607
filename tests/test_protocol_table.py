"""docs/guide/python_api.md's protocol tables name exactly what
`framework.core.protocols` declares: its protocols with their names, and
its optional names."""

import os
import re

from framework.core import protocols
from helpers import ROOT


def _rows(text, header):
  """The first cells (and second) of the table under `header`'s row."""
  lines = text[text.index(header):].splitlines()[2:]
  rows = []
  for line in lines:
    if not line.startswith("|"):
      break
    rows.append([c.strip() for c in line.strip("|").split("|")])
  return rows


def _names(cell):
  return set(re.findall(r"`(\w+)`", cell))


def test_the_guide_tables_match_the_protocols_module():
  with open(os.path.join(ROOT, "docs", "guide", "python_api.md")) as f:
    text = f.read()
  table = {_names(row[0]).pop(): _names(row[1])
           for row in _rows(text, "| protocol | declares | for |")}
  assert table == {p.__name__: set(protocols.names_of(p))
                   for p in protocols.PROTOCOLS}
  assert len(protocols.PROTOCOLS) <= 4
  optional = [_names(row[0]).pop()
              for row in _rows(text, "| name | when absent |")]
  assert optional == list(protocols.OPTIONAL)
