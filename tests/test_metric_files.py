"""metrics.jsonl: the event files' scalars point for point, also after a
kill -9 and a relaunch; a sink of one's own gets the same points."""

import csv
import glob
import json
import os
import re
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import helpers

COMMON = ["--model=mlp", "--dataset=synthetic", "--hidden_units=16",
          "--global_batch_size=32", "--optimizer=momentum",
          "--learning_rate=0.05", "--train_steps=20", "--steps_per_loop=4",
          "--summary_every=2", "--log_every=4", "--eval_every=8",
          "--checkpoint_every=8", "--export_saved_model=false"]

# train.py, killed with SIGKILL (as kill -9) when it is about to save the
# checkpoint at step $KILL_AT_SAVE: the points up to that step are written,
# the newest checkpoint is the one before.
KILLED_TRAIN = textwrap.dedent("""
    import os, signal, sys
    from absl import app
    from framework.core import controller
    kill_at = int(os.environ["KILL_AT_SAVE"])
    save = controller.Controller.save
    def killing_save(self, step):
      if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
      return save(self, step)
    controller.Controller.save = killing_save
    from scripts import train
    sys.argv[0] = "train.py"
    app.run(train.main)
""")


def event_points(model_dir):
  """{(split, name, step): value} of the event files, the last one written
  for a point written twice (what TensorBoard shows after a relaunch)."""
  points = {}
  for path in sorted(glob.glob(f"{model_dir}/**/events.out.tfevents.*",
                               recursive=True)):
    split = os.path.relpath(os.path.dirname(path), model_dir)
    events = [e for e in tf.compat.v1.train.summary_iterator(path)
              if e.HasField("summary")]
    for event in events:
      for value in event.summary.value:
        if value.metadata.plugin_data.plugin_name != "scalars":
          continue
        points[(split, value.tag, event.step)] = (
            event.wall_time, float(tf.make_ndarray(value.tensor)))
  return {k: v for k, (_, v) in points.items()}


def file_points(model_dir):
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  for line in lines:
    assert set(line) == {"step", "time", "split", "name", "value"}, line
  keys = [(p["split"], p["name"], p["step"]) for p in lines]
  assert len(keys) == len(set(keys)), "a point appears twice"
  return {k: p["value"] for k, p in zip(keys, lines)}


def assert_same_points(model_dir):
  from_events, from_file = event_points(model_dir), file_points(model_dir)
  assert sorted(from_events) == sorted(from_file)
  for key, value in from_events.items():
    # The event files hold float32.
    assert np.float32(from_file[key]) == np.float32(value), key
  return from_file


def test_metrics_file_equals_the_event_files(tmp_path):
  model_dir = tmp_path / "run"
  helpers.run_script("train.py", *COMMON, f"--model_dir={model_dir}")
  points = assert_same_points(model_dir)
  assert {(s, n, t) for s, n, t in points if n == "loss"} == (
      {("train", "loss", t) for t in range(2, 21, 2)}
      | {("eval", "loss", 8), ("eval", "loss", 16), ("eval", "loss", 20)})


@pytest.mark.slow
def test_after_kill_9_and_relaunch_every_step_once_and_as_the_events(
    tmp_path):
  model_dir = tmp_path / "run"
  proc = helpers.run_code(KILLED_TRAIN, *COMMON, f"--model_dir={model_dir}",
                          env={"KILL_AT_SAVE": "16"})
  assert proc.returncode == -9, proc.stderr[-3000:]
  before = file_points(model_dir)
  assert ("eval", "accuracy", 8) in before
  assert max(step for _, _, step in before) == 16  # past ckpt-8
  # Relaunched from another folder with a relative --model_dir.
  helpers.run_script("train.py", *COMMON, "--model_dir=run", cwd=tmp_path)
  after = assert_same_points(model_dir)
  assert sorted({step for s, n, step in after if s == "train"}) == list(
      range(2, 21, 2))
  # The steps before the restored checkpoint are the first run's points.
  for key, value in before.items():
    if key[2] <= 8:
      assert after[key] == value, key


def test_a_sink_of_ones_own_gets_every_point(tmp_path):
  # pylint: disable=g-import-not-at-top
  import framework
  from framework.core import summaries
  from framework.data import datasets, inputs
  # pylint: enable=g-import-not-at-top

  class ListSink:
    def __init__(self):
      self.points = []

    def write(self, step, split, values, time):
      self.points += [(split, name, step, value)
                      for name, value in values.items()]

  sink = ListSink()
  assert isinstance(sink, summaries.MetricSink)
  # The guide's CSV sink, as printed there.
  with open(os.path.join(helpers.ROOT, "docs/guide/python_api.md")) as f:
    guide = f.read()
  code = re.search(r"```python\n(import csv.*?class CsvSink.*?)\n```",
                   guide, re.S).group(1)
  namespace = {}
  exec(code.rsplit("\ncontroller.", 1)[0], namespace)  # pylint: disable=exec-used
  csv_path = tmp_path / "metrics.csv"
  csv_sink = namespace["CsvSink"](str(csv_path))
  csv_sink.write(1, "train", {"loss": 5.0}, 0.0)
  csv_sink.restart(0)  # a relaunch at step 0: the point goes
  strategy = tf.distribute.get_strategy()
  data = datasets.synthetic(num_train=64, num_test=32, image_shape=(4,),
                             num_classes=2)
  with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((4,)),
                                 tf.keras.layers.Dense(2)])
    trainer = framework.Trainer(model, tf.keras.optimizers.SGD(0.1),
                                strategy, global_batch_size=16)
  loop = framework.LoopConfig(train_steps=4, steps_per_loop=2,
                              summary_every=2, log_every=0)
  controller = framework.Controller(
      trainer, loop, str(tmp_path), metric_sinks=[sink, csv_sink],
      train_input=lambda start: inputs.distribute_train(
          strategy, data, 16, seed=0, start_step=start),
      eval_input=lambda: inputs.distribute_test(
          strategy, data, 16))
  controller.run()
  mine = {(s, n, t): v for s, n, t, v in sink.points}
  assert mine == file_points(tmp_path)
  assert ("train", "loss", 2) in mine and ("eval", "accuracy", 4) in mine
  with open(csv_path) as f:
    rows = list(csv.reader(f))
  assert rows[0] == ["step", "split", "name", "value"]
  assert {(s, n, int(t)): float(v) for t, s, n, v in rows[1:]} == mine
