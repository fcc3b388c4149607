"""Benchmark: a GPipe pipeline versus the unsplit model on the same cores.

    python scripts/benchmarks/model_parallel.py --num_stages=2 \
        --num_microbatches=4

Prints (not a test; figures vary with the machine and its load):
  * examples/s of the unsplit model (plain Trainer, one device) and of the
    pipeline (S stages on S logical CPU devices, or GPUs), and their ratio;
  * the measured pipeline idle fraction against GPipe's (S-1)/(M+S-1);
  * with --compare_recompute: the pipeline with --recompute too, its
    examples/s and each device's activation bytes with and without (computed
    from static shapes, see framework/model_parallel/memory.py: CPU devices
    report no measured memory).

The idle fraction is read from a profiler trace of single steps: each op
named under `stage_i/` (forward, backward, sends; not the receives, which
wait) busies device i; over the
window from the first to the last stage op, idle = 1 - sum_i busy_i / (S *
window). On logical CPU devices all stages share the same cores, so a
pipeline cannot be faster than the unsplit model there: the ratio shows its
overhead, the idle fraction shows the schedule.
"""

import os
import re
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

flags.DEFINE_integer("num_stages", 2, "Pipeline stages S.")
flags.DEFINE_integer("num_microbatches", 4, "Micro-batches M.")
flags.DEFINE_list("hidden_units", ["1024", "1024", "1024", "1024"], "MLP hidden "
                  "layers (the model being split).")
flags.DEFINE_integer("global_batch_size", 256, "Examples per step.")
flags.DEFINE_integer("steps", 10, "Steps per timed call.")
flags.DEFINE_integer("repeats", 5, "Timed calls (the best is reported).")
flags.DEFINE_integer("profiled_steps", 3, "Single steps profiled for the "
                     "idle fraction (the median is reported).")
flags.DEFINE_bool("compare_recompute", True, "Also time the pipeline with "
                  "recomputation and print activation bytes with/without.")
FLAGS = flags.FLAGS

INPUT_SHAPE, NUM_CLASSES = (32, 32, 3), 10


def _batches(tf, np):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(FLAGS.global_batch_size, *INPUT_SHAPE))
  y = rng.integers(0, NUM_CLASSES, FLAGS.global_batch_size)
  data = tf.data.Dataset.from_tensors((x.astype(np.float32),
                                       y.astype(np.int32)))
  return iter(data.repeat())


def _examples_per_second(trainers, iterators):
  """Best examples/s of each trainer, timed in turns (load drifts)."""
  for trainer, iterator in zip(trainers, iterators):
    trainer.train(iterator, FLAGS.steps)  # trace and warm up
  best = [float("inf")] * len(trainers)
  for _ in range(FLAGS.repeats):
    for i, (trainer, iterator) in enumerate(zip(trainers, iterators)):
      start = time.perf_counter()
      float(trainer.train(iterator, FLAGS.steps)["loss"])
      best[i] = min(best[i], time.perf_counter() - start)
  return [FLAGS.steps * FLAGS.global_batch_size / b for b in best]


def _union_length(intervals):
  total, end = 0, None
  for start, stop in sorted(intervals):
    if end is None or start > end:
      total += stop - start
      end = stop
    elif stop > end:
      total += stop - end
      end = stop
  return total


def _stage_intervals(xspace_path, num_stages):
  """{stage: [(start_ps, end_ps)]} of ops named under `stage_i/`."""
  from framework.perf.profiling import load_xspace  # pylint: disable=g-import-not-at-top
  space = load_xspace(xspace_path)
  pattern = re.compile(r"(?:^|/)stage_(\d+)(?:_\d+)?/[^:]*:")
  intervals = {i: [] for i in range(num_stages)}
  for plane in space.planes:
    for line in plane.lines:
      base = line.timestamp_ns * 1000
      for event in line.events:
        name = plane.event_metadata[event.metadata_id].name
        match = pattern.search(name)
        # A receive is posted early and waits: that is not work.
        if match and int(match.group(1)) < num_stages and "Recv" not in name:
          start = base + event.offset_ps
          intervals[int(match.group(1))].append(
              (start, start + event.duration_ps))
  return intervals


def _timeline(intervals, start, window, width=64):
  """One text row per stage: '#' where that stage's device was busy."""
  rows = []
  for stage, stage_intervals in sorted(intervals.items()):
    cells = ["."] * width
    for a, b in stage_intervals:
      first = int((a - start) / window * width)
      last = int((b - start) / window * width)
      for i in range(max(first, 0), min(last, width - 1) + 1):
        cells[i] = "#"
    rows.append(f"  stage {stage} |{''.join(cells)}|")
  return "\n".join(rows)


def _idle_fraction(tf, trainer, iterator, num_stages):
  """(median idle fraction, text timeline of the last profiled step)."""
  from framework.perf import profiling  # pylint: disable=g-import-not-at-top
  fractions = []
  for _ in range(FLAGS.profiled_steps):
    logdir = tempfile.mkdtemp(prefix="distloop_profile_")
    try:
      tf.profiler.experimental.start(logdir)
      float(trainer.train(iterator, 1)["loss"])
      tf.profiler.experimental.stop()
      path = profiling.latest_trace(logdir)
      intervals = _stage_intervals(path, num_stages)
    finally:
      shutil.rmtree(logdir, ignore_errors=True)
    everything = [iv for ivs in intervals.values() for iv in ivs]
    start = min(s for s, _ in everything)
    window = max(e for _, e in everything) - start
    busy = sum(_union_length(ivs) for ivs in intervals.values())
    fractions.append(1.0 - busy / (num_stages * window))
  return (sorted(fractions)[len(fractions) // 2],
          _timeline(intervals, start, window))


def main(argv):
  del argv
  import framework  # pylint: disable=g-import-not-at-top
  framework.configure_cpu_devices(FLAGS.num_stages)
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from framework.model_parallel import PipelineTrainer  # pylint: disable=g-import-not-at-top

  strategy = tf.distribute.get_strategy()
  hidden = tuple(int(u) for u in FLAGS.hidden_units)
  s, m = FLAGS.num_stages, FLAGS.num_microbatches

  def model():
    keras.utils.set_random_seed(0)
    return models.build_model("mlp", INPUT_SHAPE, NUM_CLASSES,
                              hidden_units=hidden)

  unsplit = framework.Trainer(model(), keras.optimizers.Adam(1e-4), strategy,
                              global_batch_size=FLAGS.global_batch_size)
  pipeline = PipelineTrainer(model(), keras.optimizers.Adam(1e-4), strategy,
                             global_batch_size=FLAGS.global_batch_size,
                             num_stages=s, num_microbatches=m)
  trainers = [unsplit, pipeline]
  if FLAGS.compare_recompute:
    trainers.append(PipelineTrainer(
        model(), keras.optimizers.Adam(1e-4), strategy,
        global_batch_size=FLAGS.global_batch_size, num_stages=s,
        num_microbatches=m, recompute=True))
  rates = _examples_per_second(trainers, [_batches(tf, np) for _ in trainers])
  base_rate, pipe_rate = rates[:2]
  idle, timeline = _idle_fraction(tf, pipeline, _batches(tf, np), s)
  gpipe = (s - 1) / (m + s - 1)
  devices = [stage.device for stage in pipeline.stages]
  print(f"model: mlp hidden={list(hidden)} "
        f"({unsplit.model.count_params()} params), global batch "
        f"{FLAGS.global_batch_size}; stages on {devices}, boundaries "
        f"{list(pipeline.boundaries)}")
  print(f"unsplit:  {base_rate:9.1f} examples/s")
  print(f"pipeline: {pipe_rate:9.1f} examples/s  (S={s}, M={m})")
  print(f"throughput ratio pipeline/unsplit: {pipe_rate / base_rate:.3f}")
  print(f"idle fraction: measured {idle:.3f}, GPipe (S-1)/(M+S-1) = "
        f"{gpipe:.3f}")
  print(f"busy time per stage device over one step:\n{timeline}")
  if FLAGS.compare_recompute:
    print(f"pipeline --recompute: {rates[2]:9.1f} examples/s (step time "
          f"x{pipe_rate / rates[2]:.3f} of without)")
    for device in pipeline.memory:
      print(f"activation bytes {device}: "
            f"{pipeline.memory[device].get('activation_bytes')} without, "
            f"{trainers[2].memory[device].get('activation_bytes')} with "
            "--recompute")


if __name__ == "__main__":
  app.run(main)
