"""kill -9 of scripts/make_tfrecords.py at seeded points while it writes and
publishes over an existing set: the output folder always reads as exactly
the old set or the new one, and the next converter run removes what the
killed one left. The converter stops itself through its test hook
(DISTLOOP_MAKE_TFRECORDS_KILL_AT=k: SIGKILL before its k-th file
operation), so the kills land between any two file operations."""

import os
import re
import shutil

import numpy as np
import pytest

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from framework.data import datasets, tfrecord_set, tfrecords
from tests.helpers import run_script
from tests.test_data_fuzz import read_all

NUM_KILLS = 20
KILL_ENV = "DISTLOOP_MAKE_TFRECORDS_KILL_AT"
SEED = 7


def _cifar(path, seed):
  rng = np.random.default_rng(seed)
  framework.data.datasets.write_cifar10(
      str(path), rng.integers(0, 256, (12, 32, 32, 3), dtype=np.uint8),
      rng.integers(0, 10, 12), rng.integers(0, 256, (4, 32, 32, 3),
                                            dtype=np.uint8),
      rng.integers(0, 10, 4))
  return str(path)


def _convert(src, out, *extra, env=None, check=True):
  return run_script("make_tfrecords.py", "--dataset=cifar10",
                    f"--data_dir={src}", f"--output_dir={out}",
                    "--num_shards=3", *extra, env=env, check=check)


def _leftovers(path):
  return [n for n in os.listdir(path)
          if n.startswith(".") or re.fullmatch(r"gen-\w+", n)]


def _flat(src, out):
  """The set as older converters left it: shards and sidecars directly in
  `out` (no dataset.json)."""
  data = datasets.load_cifar10(src)
  for split, x, y in (("train", data.train_x, data.train_y),
                      ("test", data.test_x, data.test_y)):
    tfrecords.write_split(str(out), split, lambda i, x=x, y=y: (x[i], y[i]),
                          len(x), num_shards=3, class_names=data.class_names)
  return str(out)


def _total_ops(base, src, tmp_path):
  probe = tmp_path / "probe"
  shutil.copytree(base, probe)
  proc = _convert(src, probe, "--verbosity=1")
  total = max(int(n) for n in re.findall(r"file operation (\d+):",
                                         proc.stderr))
  new = read_all(str(probe))
  shutil.rmtree(probe)
  return total, new


@pytest.mark.slow
def test_killed_converter_leaves_the_old_set_or_the_new_one(tmp_path):
  old_src, new_src = _cifar(tmp_path / "old", 1), _cifar(tmp_path / "new", 2)
  # Kills over a folder in the flat layout (its first publish) and over a
  # published generation (a re-conversion).
  bases = [_flat(old_src, tmp_path / "flat"), str(tmp_path / "published")]
  _convert(old_src, bases[1])
  old = read_all(bases[0])
  assert read_all(bases[1]) == old
  totals, news = zip(*[_total_ops(b, new_src, tmp_path) for b in bases])
  new = news[0]
  assert news[1] == new and isinstance(old, dict) and old != new
  rng = np.random.default_rng(SEED)
  outcomes = {"old": 0, "new": 0}
  kills = []
  for i in range(NUM_KILLS):
    base = i % 2
    k = int(rng.integers(1, totals[base] + 1))
    kills.append((base, k))
    out = tmp_path / f"kill{i}"
    shutil.copytree(bases[base], out)
    proc = _convert(new_src, out, env={KILL_ENV: str(k)}, check=False)
    assert proc.returncode == -9, (k, proc.returncode, proc.stderr[-2000:])
    got = read_all(str(out))
    assert got in (old, new), f"kill before file operation {k}: {got}"
    outcomes["old" if got == old else "new"] += 1
    # What the next converter run does first: the dead converter's
    # staging goes.
    tfrecord_set.remove_stale_staging(str(out))
    assert not [n for n in os.listdir(out) if n.startswith(".")], k
    shutil.rmtree(out)
  print(f"converter kills: {NUM_KILLS} at (base, file operation) {kills}, "
        f"file operations {totals}: {outcomes}")
  assert outcomes["old"] and outcomes["new"]
  # A real rerun after a kill mid-write cleans up and publishes the new set.
  out = tmp_path / "rerun"
  shutil.copytree(bases[1], out)
  _convert(new_src, out, env={KILL_ENV: "4"}, check=False)
  assert [n for n in os.listdir(out) if n.startswith(".make_tfrecords-")]
  _convert(new_src, out)
  assert read_all(str(out)) == new
  assert len([n for n in os.listdir(out) if n != "dataset.json"]) == 1
