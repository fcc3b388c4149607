"""Peak activation memory and time per step of the GPT per `--recompute`.

    python scripts/benchmarks/recompute_memory.py --json=/tmp/recompute.json

Memory: each setting runs in a fresh process (`--one=VALUE`): build the
GPT and its optimizer, note the process's peak resident memory
(`ru_maxrss`), run 1 + `--timed_steps` train steps, note the peak again. The
difference is what the steps held at their peak beyond the built model: the
traced function, gradients and slots (alike for every setting) and the
activations kept for the backward pass (what recomputation changes). CPU
devices keep no allocator statistics:
`tf.config.experimental.get_memory_info("CPU:0")` returns zeros for CPU in
TensorFlow 2.21, hence the peak RSS.

Time: one process (`--timing`) builds every setting, runs each
`--warmup_steps` steps, then `--rounds` rounds of one step of each in turn;
the median step per setting and its ratio to the first setting's. Steps
timed in separate processes on a loaded host differ by several times from
one process to the next; alternating steps in one process see the same load.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from framework.settings import default  # pylint: disable=g-import-not-at-top,wrong-import-position
from models.options import ModelOptions  # pylint: disable=g-import-not-at-top,wrong-import-position
from scripts.benchmarks import host  # pylint: disable=g-import-not-at-top,wrong-import-position

flags.DEFINE_list("settings", ["none", "blocks", "attention", "every:2"],
                  "--recompute values to compare.")
flags.DEFINE_string("one", None, "Measure this one value (a child run).")
flags.DEFINE_integer("width", 256, "Model width.")
flags.DEFINE_integer("sequence_length", 512, "Tokens per example.")
flags.DEFINE_integer("num_layers", 4, "Blocks.")
flags.DEFINE_integer("num_heads", default(ModelOptions, "num_heads"), "Heads.")
flags.DEFINE_integer("batch", 4, "Sequences per step.")
flags.DEFINE_integer("timed_steps", 3, "Memory: steps after the first.")
flags.DEFINE_integer("warmup_steps", 2, "Time: untimed steps per setting.")
flags.DEFINE_integer("rounds", 8, "Time: rounds of one step per setting.")
flags.DEFINE_bool("timing", False, "Time every setting in this process (a "
                  "child run).")
flags.DEFINE_string("json", "", "Write the results here too.")
FLAGS = flags.FLAGS


def _peak_mib():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_step(value):
  """The GPT made under `--recompute=value`, its optimizer and a traced,
  run train step."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from framework.model_parallel import recompute  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  with recompute.policy(value) as declared:
    model = models.build_model(
        "gpt", (FLAGS.sequence_length,), 256, num_layers=FLAGS.num_layers,
        num_heads=FLAGS.num_heads, model_width=FLAGS.width)
  recompute.apply(model, value, declared)
  optimizer = keras.optimizers.Adam(1e-4)
  optimizer.build(model.trainable_variables)
  built = _peak_mib()
  tokens = np.random.RandomState(0).randint(
      0, 256, (FLAGS.batch, FLAGS.sequence_length + 1)).astype("int32")
  x, y = tf.constant(tokens[:, :-1]), tf.constant(tokens[:, 1:])

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      logits = model(x, training=True)
      loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
          y, logits, from_logits=True))
    optimizer.apply(tape.gradient(loss, model.trainable_variables),
                    model.trainable_variables)
    return loss

  step().numpy()  # trace and first step
  return step, built


def measure(value):
  """{peak_rss_mib, built_rss_mib, steps_peak_mib} of one setting, in this
  (fresh) process."""
  step, built = build_step(value)
  for _ in range(FLAGS.timed_steps):
    step().numpy()
  return {"recompute": value, "peak_rss_mib": round(_peak_mib(), 1),
          "built_rss_mib": round(built, 1),
          "steps_peak_mib": round(_peak_mib() - built, 1)}


def timing(values):
  """{value: median seconds per step}, the settings' steps alternating."""
  steps = {v: build_step(v)[0] for v in values}
  for step in steps.values():
    for _ in range(FLAGS.warmup_steps):
      step().numpy()
  times = {v: [] for v in values}
  for _ in range(FLAGS.rounds):
    for value, step in steps.items():
      start = time.perf_counter()
      step().numpy()
      times[value].append(time.perf_counter() - start)
  return {v: statistics.median(t) for v, t in times.items()}


def main(argv):
  del argv
  if FLAGS.one is not None:
    print(json.dumps(measure(FLAGS.one)))
    return
  if FLAGS.timing:
    print(json.dumps(timing(FLAGS.settings)))
    return
  names = ("width", "sequence_length", "num_layers", "num_heads", "batch",
           "timed_steps", "warmup_steps", "rounds")
  shared = [f"--{n}={FLAGS[n].value}" for n in names]

  def child(*args):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args,
                          *shared], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])

  load_before = host.load_average()
  rows = [child(f"--one={value}") for value in FLAGS.settings]
  seconds = child("--timing", "--settings=" + ",".join(FLAGS.settings))
  load_after = host.load_average()
  for row in rows:
    row["step_s"] = round(seconds[row["recompute"]], 3)
    row["time_vs_first"] = round(
        seconds[row["recompute"]] / seconds[rows[0]["recompute"]], 2)
  base = rows[0]["peak_rss_mib"]
  print(f"{load_before} before, {load_after} after")
  print("| --recompute | peak RSS (MiB) | vs the first | steps' peak over "
        "the built model (MiB) | time per step (s) | time vs the first |")
  print("|---|---|---|---|---|---|")
  for row in rows:
    print(f"| {row['recompute']} | {row['peak_rss_mib']:.0f} | "
          f"{row['peak_rss_mib'] - base:+.0f} | {row['steps_peak_mib']:.0f} | "
          f"{row['step_s']:.3f} | {row['time_vs_first']:.2f}x |")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump({"config": {n: FLAGS[n].value for n in names},
                 "host": {"cpu": host.cpu_model(), "cores": os.cpu_count(),
                          "load_before": load_before,
                          "load_after": load_after},
                 "rows": rows}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
