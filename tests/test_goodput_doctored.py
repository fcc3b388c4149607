"""A goodput.json whose numbers were edited (NaN, negative, inf, a launch
count below 1, a start after its end, parts beyond its wall time, a record
from the future, the computed `wall`/`other` among its parts) is a warning and the account counts
from this launch, never a report of nan% or -2 launches."""

import json
import math

import pytest

from framework.core import goodput


def _written(tmp_path):
  account = goodput.Goodput(str(tmp_path), start_time=100.0)
  account.training(110.0)
  account.loop(1, 2, 8.0)
  account.loop(3, 4, 2.0)
  account.write(now=130.0)
  return json.loads((tmp_path / goodput.GOODPUT_FILE).read_text())


@pytest.mark.parametrize("edit", [
    lambda r: r["seconds"].update(productive="NaN"),
    lambda r: r["seconds"].update(startup=-5.0),
    lambda r: r["seconds"].update(checkpoint="Infinity"),
    lambda r: r.update(launches=-3),
    lambda r: r.update(first_start=1e9),
    lambda r: r["pending"].append([9, 3, 1.0]),
    lambda r: r["lost_step_counts"].update(skipped=-1),
    lambda r: r["seconds"].update(productive=1e300),
    lambda r: r["pending"].append([5, 9, 1e300]),
    lambda r: r["seconds"].update(wall=1.0),
    lambda r: r["seconds"].update(other=1.0),
    lambda r: r.update(first_start=1e12, last_time=1e12 + 1),
])
def test_an_edited_account_counts_from_this_launch(tmp_path, edit):
  record = _written(tmp_path)
  edit(record)
  (tmp_path / goodput.GOODPUT_FILE).write_text(json.dumps(record))
  account = goodput.Goodput(str(tmp_path), start_time=200.0)
  assert account.launches == 1 and account.first_start == 200.0
  parts = account.account(now=210.0)
  assert all(math.isfinite(v) and v >= 0 for v in parts.values()), parts
  assert parts["wall"] == 10.0


def test_an_intact_account_is_read_back(tmp_path):
  _written(tmp_path)
  account = goodput.Goodput(str(tmp_path), start_time=135.0)
  assert account.launches == 2 and account.seconds["restart"] == 5.0
