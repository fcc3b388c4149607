"""Streaming TFRecord shards on real clusters (framework/data/file_input.py).

2 worker processes under multi_worker_mirrored, and chief + 2 workers + 1 ps
under parameter_server, train on a small TFRecord directory written here.
With --verbosity=1 every group of shards a pipeline reads prints
`<name> train: input pipeline i read shards [ids] : n records` on the task
that reads it, so each worker's log says which files it opened and how many
records it got; the INFO lines `<name> test: input pipeline i/P reads shards
..., n examples` and the evaluation's `examples=` count the test set.
Timeouts here only stop a hang.
"""

import json
import os
import re

import pytest

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from framework.data import tfrecords
from tests import cluster_utils as cu

NUM_TRAIN, NUM_TEST = 240, 51  # 51: the last eval batch of each worker partial
TRAIN_SHARDS, TEST_SHARDS = 6, 4
READ = re.compile(r"^\[(\w+):(\d)\] .*tiny train: input pipeline (\d+) read "
                  r"shards \[([\d ]+)\] : (\d+) records$", re.M)
TEST_PLAN = re.compile(r"^\[(\w+):(\d)\] .*tiny test: input pipeline "
                       r"(\d+)/(\d+) reads shards ([\d,]+) \(\d+ of \d+ "
                       r"shards\), (\d+) examples$", re.M)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """A TFRecord directory: 6 train shards of 40, 4 test shards (13,13,13,12)."""
  path = str(tmp_path_factory.mktemp("tiny_tfr"))
  data = framework.data.datasets.synthetic(num_train=NUM_TRAIN, num_test=NUM_TEST,
                             image_shape=(8, 8, 3), seed=1)
  for split, x, y, shards in (
      ("train", data.train_x, data.train_y, TRAIN_SHARDS),
      ("test", data.test_x, data.test_y, TEST_SHARDS)):
    tfrecords.write_split(path, split, lambda i, x=x, y=y: (x[i], y[i]),
                          len(x), num_shards=shards,
                          class_names=data.class_names, name="tiny")
  return path


def _counts(path, split):
  return json.load(open(os.path.join(path, f"{split}.json")))[
      "examples_per_shard"]


def _reads(output):
  """{task: {shard id}} of the train shards each task read, checking that
  every read of a group returned exactly its shards' records."""
  return [(f"{role}:{task}", int(pipeline), [int(i) for i in ids.split()],
           int(records))
          for role, task, pipeline, ids, records in READ.findall(output)]


def _check_train_reads(output, files, role):
  counts = _counts(files, "train")
  read = {}
  for task, pipeline, ids, records in _reads(output):
    assert task.startswith(role), task
    # Worker i is input pipeline i, and a group read gives all its records.
    assert pipeline == int(task.split(":")[1]), (task, pipeline)
    assert records == sum(counts[i] for i in ids), (task, ids, records)
    read.setdefault(task, set()).update(ids)
  # Each worker opened exactly its own shards: i, i + 2, i + 4.
  assert read == {f"{role}:0": {0, 2, 4}, f"{role}:1": {1, 3, 5}}, (
      output[-4000:])


@pytest.mark.slow
def test_two_mirrored_workers_read_disjoint_shards_and_eval_counts_each_once(
    files, tmp_path):
  model_dir = str(tmp_path / "run")
  proc = cu.launch(["--model=mlp", "--dataset=tfrecord",
                    f"--data_dir={files}", "--global_batch_size=16",
                    "--strategy=multi_worker_mirrored", "--train_steps=10",
                    "--steps_per_loop=5", "--eval_every=10",
                    "--checkpoint_every=10", "--verbosity=1",
                    f"--model_dir={model_dir}"], workers=2)
  output = proc.stdout
  assert proc.returncode == 0, output[-4000:]
  assert cu.global_step(model_dir) == 10
  _check_train_reads(output, files, "worker")
  # Evaluation: each worker reads its half of the test shards ...
  test_counts = _counts(files, "test")
  plans = {}
  for role, task, pipeline, pipelines, ids, examples in TEST_PLAN.findall(
      output):
    assert (role, task, pipelines) == ("worker", pipeline, "2")
    ids = [int(i) for i in ids.split(",")]
    assert int(examples) == sum(test_counts[i] for i in ids)
    plans[int(task)] = (set(ids), int(examples))
  assert plans[0][0] == {0, 2} and plans[1][0] == {1, 3}, output[-4000:]
  assert plans[0][1] + plans[1][1] == NUM_TEST
  # ... and the evaluation counts every test example once over the two,
  # the partial last batches (26 and 25 = 3 x 8 + 2 and 3 x 8 + 1) too.
  [examples] = re.findall(r"^\[worker:0\] .*eval  step 10: .*examples=(\d+)",
                          output, re.M)
  assert int(examples) == NUM_TEST


@pytest.mark.slow
def test_parameter_server_workers_stream_their_own_shards(files, tmp_path):
  model_dir = str(tmp_path / "run")
  proc = cu.launch(["--model=mlp", "--dataset=tfrecord",
                    f"--data_dir={files}", "--global_batch_size=16",
                    "--strategy=parameter_server", "--train_steps=40",
                    "--steps_per_loop=10", "--eval_every=20",
                    "--checkpoint_every=20", "--verbosity=1",
                    f"--model_dir={model_dir}"], workers=2, ps=1, timeout=600)
  output = proc.stdout
  assert proc.returncode == 0, output[-4000:]
  assert "train step 40/40" in output
  assert cu.checkpoint_step(model_dir) == 40 and cu.global_step(model_dir) == 40
  assert {"model_info.json", "model.weights.h5", "checkpoint", "train",
          "eval"} <= set(os.listdir(model_dir))
  # The workers, not the coordinator, read the training shards: each its own.
  _check_train_reads(output, files, "worker")
  # The coordinator evaluates the whole test set, once.
  assert re.search(r"^\[chief:0\] .*tiny test: input pipeline 0/1 reads "
                   rf"shards 0,1,2,3 \(4 of 4 shards\), {NUM_TEST} examples$",
                   output, re.M), output[-4000:]
  evals = re.findall(r"^\[chief:0\] .*eval  step (\d+): .*examples=(\d+)",
                     output, re.M)
  assert evals == [("20", str(NUM_TEST)), ("40", str(NUM_TEST))], evals
