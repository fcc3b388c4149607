"""Writes tests/durations.txt from a `pytest --durations=0` report.

    python -m pytest -q --durations=0 tests > /tmp/report.txt
    python tests/durations.py /tmp/report.txt

Each line of durations.txt is "seconds nodeid" (setup + call + teardown,
measured on an idle 2-core machine without -n). conftest.py marks `slow` the
tests at SLOW_SECONDS or more, and under pytest-xdist hands out whole test
files longest first.
"""

import collections
import os
import re
import sys

SLOW_SECONDS = 1.0
PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                    "durations.txt")
_HEADER = """\
# Seconds per test (setup + call + teardown), from `pytest --durations=0`
# on an idle 2-core machine without -n; tests not listed took < 5 ms.
# tests/conftest.py marks the tests at 1 s or more `slow` and, under
# pytest-xdist, hands out whole files longest first. Regenerate with
# tests/durations.py when tests change.
"""


def parse(lines):
  """{nodeid: seconds} summed over setup, call and teardown."""
  seconds = collections.Counter()
  for line in lines:
    # A parametrised id may hold spaces ("[data:2,model:2 momentum]").
    m = re.match(r"^([0-9.]+)s (?:call|setup|teardown)\s+(\S.*?)\s*$", line)
    if m:
      seconds[m.group(2)] += float(m.group(1))
  return seconds


def load(path=PATH):
  """{nodeid: seconds} from durations.txt ({} when it is missing)."""
  if not os.path.exists(path):
    return {}
  seconds = {}
  with open(path) as f:
    for line in f:
      if line.strip() and not line.startswith("#"):
        value, nodeid = line.split(maxsplit=1)
        seconds[nodeid.strip()] = float(value)
  return seconds


def main(argv):
  if len(argv) != 2:
    sys.exit(f"usage: {argv[0]} REPORT (pytest --durations=0 output)")
  with open(argv[1]) as f:
    seconds = parse(f)
  if not seconds:
    sys.exit(f"{argv[1]}: no durations (run pytest with --durations=0)")
  with open(PATH, "w") as f:
    f.write(_HEADER)
    for nodeid in sorted(seconds):
      f.write(f"{seconds[nodeid]:.2f} {nodeid}\n")
  slow = sum(s >= SLOW_SECONDS for s in seconds.values())
  print(f"{PATH}: {len(seconds)} tests, {slow} slow, "
        f"{sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
  main(sys.argv)
