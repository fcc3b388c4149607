"""A seeded damage fuzzer over a small TFRecord set and its sidecars.

Each case damages a fresh copy of an intact set (truncates a shard at a
random offset, flips a random bit, deletes, duplicates, swaps or extends
shards, or mutates one sidecar field) and reads every split through the
reader training uses. A case passes when the examples read equal the intact
set's, or when the read ends in one `DataError` line; anything else (other
examples, another exception, a multi-line message) fails the test. The
outcome table is printed (pytest -s) and written to $DISTLOOP_FUZZ_TABLE.
"""

import collections
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from framework.data import file_input, integrity, tfrecords
from framework.errors import DataError

SEED = 20261201
NUM_FILE_CASES = 24


def _write(path):
  data = framework.data.datasets.synthetic(num_train=24, num_test=8, image_shape=(4, 4, 3),
                             num_classes=3, seed=5)
  for split, x, y, shards in (("train", data.train_x, data.train_y, 3),
                              ("test", data.test_x, data.test_y, 2)):
    tfrecords.write_split(str(path), split, lambda i, x=x, y=y: (x[i], y[i]),
                          len(x), num_shards=shards,
                          class_names=data.class_names, name="fuzz")
  return str(path)


def read_all(data_dir):
  """{split: sorted [(index, image bytes, label)]} as training reads them,
  or the DataError raised."""
  try:
    dataset = file_input.load_tfrecord(data_dir)
    out = {}
    for split in (dataset.train, dataset.test):
      ids = tf.range(len(split.counts), dtype=tf.int64)
      rows = split.read(ids).map(split.decode)
      out[len(out)] = sorted((int(i), im.tobytes(), int(l))
                             for i, im, l in rows.as_numpy_iterator())
    return out
  except DataError as e:
    return e
  except tf.errors.OpError as e:
    error = integrity.data_error(e)
    if error is None:
      raise
    return error


def _shards(path, split=None):
  return sorted(f for f in os.listdir(path) if f.endswith(".tfrecord")
                and (split is None or f.startswith(split)))


def _file_damage(rng, path):
  """Damages shard files in `path`; returns the case's name."""
  shards = _shards(path)
  kind = rng.choice(["truncate", "flip", "delete", "copy_over", "swap",
                     "append", "empty"])
  a, b = rng.choice(shards, 2, replace=False)
  pa, pb = os.path.join(path, a), os.path.join(path, b)
  data = bytearray(open(pa, "rb").read())
  if kind == "truncate":
    open(pa, "wb").write(data[:int(rng.integers(1, len(data)))])
  elif kind == "flip":
    bit = int(rng.integers(len(data) * 8))
    data[bit // 8] ^= 1 << (bit % 8)
    open(pa, "wb").write(data)
  elif kind == "delete":
    os.remove(pa)
  elif kind == "copy_over":
    shutil.copyfile(pa, pb)
  elif kind == "swap":
    other = open(pb, "rb").read()
    open(pb, "wb").write(data)
    open(pa, "wb").write(other)
  elif kind == "append":
    open(pb, "ab").write(data)
  else:
    open(pa, "wb").close()
  return kind


def _mutations(sidecar):
  """(name, mutate(dict) or None to replace the whole file)."""
  cases = []
  for field, value in sidecar.items():
    variants = {"missing": "<del>", "null": None, "string": "7",
                "list_of_list": [[1, 2]], "negative": -64, "bool": True}
    if isinstance(value, list) and value:
      variants.update(
          short=value[:-1], empty=[], reversed=value[::-1],
          first_negative=[-64] + value[1:] if isinstance(value[0], int) else
          ["x"] + value[1:],
          as_strings=[str(v) for v in value],
          shifted=([value[0] + 192] + value[1:])
          if isinstance(value[0], int) and not isinstance(value[0], bool)
          else value[1:] + value[:1])
    elif isinstance(value, int):
      variants.update(plus_one=value + 1, zero=0)
    elif isinstance(value, str):
      variants.update(other=value + "x", empty="")
    for name, new in variants.items():
      cases.append((f"{field}={name}", field, new))
  cases += [("image_shape=C1", "image_shape", sidecar["image_shape"][:2] + [1]),
            ("image_shape=2D", "image_shape", sidecar["image_shape"][:2]),
            ("label_shape=HW", "label_shape", sidecar["image_shape"][:2]),
            ("class_names=2", "class_names", sidecar["class_names"][:2])]
  return cases


def _run(intact, case_dir, outcomes, name):
  got = read_all(case_dir)
  if isinstance(got, DataError):
    message = str(got)
    assert "\n" not in message, f"{name}: {message}"
    outcome = "one DataError line"
  elif got == intact:
    outcome = "exact read"
  else:
    pytest.fail(f"{name}: the examples read differ from the intact set")
  outcomes[(name.split("=")[0], outcome)] += 1
  return outcome


def test_damaged_sets_read_exactly_or_fail_in_one_line(tmp_path):
  clean = _write(tmp_path / "clean")
  intact = read_all(clean)
  assert isinstance(intact, dict) and len(intact[0]) == 24
  rng = np.random.default_rng(SEED)
  outcomes = collections.Counter()
  cases = 0
  for case in range(NUM_FILE_CASES):
    case_dir = str(tmp_path / f"file{case}")
    shutil.copytree(clean, case_dir)
    kind = _file_damage(rng, case_dir)
    _run(intact, case_dir, outcomes, f"shard:{kind}")
    shutil.rmtree(case_dir)
    cases += 1
  for split in ("train", "test"):
    sidecar = json.load(open(os.path.join(clean, f"{split}.json")))
    mutations = _mutations(sidecar)
    # A seeded sample keeps the test fast; every field is mutated at least
    # once per split (the first variant of each field is kept).
    keep = {m[1]: m for m in mutations[::-1]}
    chosen = list(keep.values()) + [
        mutations[i] for i in rng.choice(len(mutations), 4, replace=False)]
    for name, field, new in chosen:
      case_dir = str(tmp_path / f"{split}-{name}")
      shutil.copytree(clean, case_dir)
      mutated = dict(sidecar)
      if new == "<del>":
        del mutated[field]
      else:
        mutated[field] = new
      with open(os.path.join(case_dir, f"{split}.json"), "w") as f:
        json.dump(mutated, f)
      _run(intact, case_dir, outcomes, f"sidecar {field}={name}")
      shutil.rmtree(case_dir)
      cases += 1
  for name, text in (("sidecar:top-level list", "[1, 2]"),
                     ("sidecar:not json", "{\"format\": "),
                     ("sidecar:empty", "")):
    case_dir = str(tmp_path / "whole")
    shutil.copytree(clean, case_dir)
    with open(os.path.join(case_dir, "train.json"), "w") as f:
      f.write(text)
    _run(intact, case_dir, outcomes, name)
    shutil.rmtree(case_dir)
    cases += 1
  table = [f"damage fuzzer (seed {SEED}): {cases} cases"]
  table += [f"  {kind:28s} {outcome:20s} {n}"
            for (kind, outcome), n in sorted(outcomes.items())]
  totals = collections.Counter()
  for (_, outcome), n in outcomes.items():
    totals[outcome] += n
  table.append("  total: " + ", ".join(f"{o} {n}" for o, n in
                                       sorted(totals.items())))
  print("\n".join(table))
  if os.environ.get("DISTLOOP_FUZZ_TABLE"):
    with open(os.environ["DISTLOOP_FUZZ_TABLE"], "w") as f:
      f.write("\n".join(table) + "\n")
  assert sum(outcomes.values()) == cases
  assert totals["one DataError line"] > cases // 2
