"""Peak memory on a dataset larger than 2 GiB, and resume latency within it.

    python scripts/benchmarks/large_dataset.py            # > 2 GiB: ~20 min
    python scripts/benchmarks/large_dataset.py --large_mib=300   # a try-out

Issue 12's parts (b) and (c), with the real converter and train.py:

(b) `scripts/make_tfrecords.py --dataset=synthetic` writes a large dataset
  (`--large_mib` of noise PNGs, default > 2 GiB) and a small one
  (`--small_mib`, default 50 MiB) of the same image shape and the same shard
  size (`--shard_mib`: the streaming pipeline holds a few groups of shards,
  so the shard size, not the dataset size, should set the memory). train.py
  (`--dataset=tfrecord`, a small MLP) trains the same number of steps on
  each: one epoch of the large set less one step, so the large run reads
  nearly all of it. Prints each run's peak resident memory (the child's
  ru_maxrss from wait4) and their ratio; the goal is large/small <= 1.5x.
(c) Resume latency at the start vs. the end of an epoch of the large set:
  - in-process: seconds from building `FileDataset.train_dataset` at
    `start_step` to its first batch, for step 1 and for the epoch's last
    step (median of `--resume_repeats`); for reference, the same batch
    reached by running the stream from step 0 (`--replay`);
  - train.py: restarts from a checkpoint saved at step 1 and from the large
    run's checkpoint (the epoch's last step but one), each training one
    more step; timed from the "Restored checkpoint" log line to the logged
    step (restore done -> input positioned, train step traced and run), and
    as the whole process.
  The pipeline skips the groups before the offset on the sidecar's counts
  and reads only the group holding it, so both should be about equal.

Everything is written in a fresh folder under `--work_dir` and deleted at the
end (also on failure or Ctrl-C) unless `--keep`.
"""

import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from absl import app  # pylint: disable=g-import-not-at-top
from scripts import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()
from absl import flags

from framework.data import tfrecord_set  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_string("work_dir", None, "A fresh folder is made (and deleted) "
                    "in here; default: the system's temporary folder.")
flags.DEFINE_bool("keep", False, "Keep the datasets, checkpoints and logs.")
flags.DEFINE_list("shape", ["96", "96", "3"], "Image shape H,W,C.")
flags.DEFINE_float("large_mib", 2200, "Size of the large training split "
                   "(MiB of raw pixels; the PNGs of noise are slightly more).")
flags.DEFINE_float("small_mib", 50, "Size of the small training split.")
flags.DEFINE_integer("large_examples", None, "Overrides --large_mib.")
flags.DEFINE_integer("small_examples", None, "Overrides --small_mib.")
flags.DEFINE_integer("test_examples", 256, "Test examples of each set.")
flags.DEFINE_float("shard_mib", 16, "Shard size of both sets (MiB).")
flags.DEFINE_integer("global_batch_size", 64, "Examples per step.")
flags.DEFINE_integer("train_steps", None, "Steps of both memory runs "
                     "(default: one epoch of the large set less one).")
flags.DEFINE_list("hidden_units", ["16"], "The MLP's hidden layers (small: "
                  "small checkpoints).")
flags.DEFINE_integer("resume_repeats", 3, "In-process timings per step.")
flags.DEFINE_bool("replay", True, "Also time the first batch at the end of "
                  "the epoch reached by running the stream from step 0 (what "
                  "a resume without skipping would cost; reads the epoch).")
for _name in ("large_examples", "small_examples", "test_examples",
              "global_batch_size", "train_steps", "resume_repeats"):
  flags.register_validator(_name, lambda v: v is None or v > 0,
                           message=f"--{_name} must be a positive integer")

GIB = 1 << 30
MIB = 1 << 20
_LOG_TIME = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d\.\d+) ")


class Failed(Exception):
  """A child process failed; the message holds the end of its log."""


def _shape():
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    shape = tuple(int(v) for v in FLAGS.shape)
  except ValueError:
    shape = ()
  if len(shape) != 3 or min(shape) <= 0:
    raise ConfigError(f"--shape={','.join(FLAGS.shape)} must be three "
                         "positive integers H,W,C")
  return shape


def _run(name, script, args, logs):
  """Runs a script of scripts/; returns (its log, peak RSS MiB, seconds)."""
  log = os.path.join(logs, f"{name}.log")
  env = dict(os.environ, PYTHONPATH=ROOT)
  start = time.perf_counter()
  with open(log, "w") as f:
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "scripts", script), *args],
        stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    # wait4: this child's own rusage (RUSAGE_CHILDREN would be the maximum
    # over every child so far, the converter's included).
    _, status, usage = os.wait4(proc.pid, 0)
  seconds = time.perf_counter() - start
  proc.returncode = os.waitstatus_to_exitcode(status)
  with open(log) as f:
    text = f.read()
  if proc.returncode != 0:
    raise Failed(f"{name} ({script}) exited {proc.returncode}:\n"
                 f"{text[-3000:]}")
  return text, usage.ru_maxrss / 1024, seconds  # ru_maxrss: KiB on Linux


def _train_bytes(data_dir):
  # The converter publishes each generation in its own folder.
  data_dir = tfrecord_set.resolve(data_dir)
  return sum(os.path.getsize(os.path.join(data_dir, name))
             for name in os.listdir(data_dir)
             if name.startswith("train-") and name.endswith(".tfrecord"))


def _write(name, examples, shape, root, logs):
  """Converts a synthetic set; returns (its folder, train bytes, seconds)."""
  out = os.path.join(root, name)
  shards = max(1, math.ceil(examples * math.prod(shape) /
                            (FLAGS.shard_mib * MIB)))
  _, _, seconds = _run(f"convert_{name}", "make_tfrecords.py", [
      "--dataset=synthetic", f"--synthetic_train={examples}",
      f"--synthetic_test={FLAGS.test_examples}",
      f"--synthetic_shape={','.join(map(str, shape))}",
      f"--output_dir={out}", f"--num_shards={shards}"], logs)
  size = _train_bytes(out)
  print(f"{name}: {examples:,} train examples {'x'.join(map(str, shape))} in "
        f"{shards} shards: {size:,} bytes ({size / GIB:.2f} GiB) on disk, "
        f"written in {seconds:.0f} s", flush=True)
  return out, size


def _log_seconds(text, pattern):
  """Seconds of the day of the first log line matching `pattern`."""
  for line in text.splitlines():
    match = _LOG_TIME.match(line)
    if match and re.search(pattern, line):
      h, m, s = match.groups()
      return int(h) * 3600 + int(m) * 60 + float(s)
  raise Failed(f"no log line matches {pattern!r}:\n{text[-3000:]}")


def _restore_to_step(text, step):
  """Seconds from "Restored checkpoint" to the log line of `step`."""
  restored = _log_seconds(text, r"Restored checkpoint")
  stepped = _log_seconds(text, rf"train step {step}/")
  return (stepped - restored) % 86400  # a run across midnight


def _first_batch_seconds(dataset, step):
  start = time.perf_counter()
  next(iter(dataset.train_dataset(FLAGS.global_batch_size,
                                  start_step=step)))
  return time.perf_counter() - start


def _resume_in_process(data_dir, last):
  from framework.data import file_input  # pylint: disable=g-import-not-at-top
  dataset = file_input.load_tfrecord(data_dir)
  _first_batch_seconds(dataset, 0)  # warm-up
  times = {1: [], last: []}
  for repeat in range(FLAGS.resume_repeats):
    # Alternate which step goes first: no order effect in the medians.
    for step in (1, last) if repeat % 2 == 0 else (last, 1):
      times[step].append(_first_batch_seconds(dataset, step))
  medians = {step: statistics.median(t) for step, t in times.items()}
  replay = None
  if FLAGS.replay:
    # What resuming would cost without the offset: the stream from step 0
    # run through to the step (every record read and decoded).
    start = time.perf_counter()
    next(iter(dataset.train_dataset(FLAGS.global_batch_size).skip(last)))
    replay = time.perf_counter() - start
  return medians, replay


def _ratio_line(label, start, end, unit="s"):
  print(f"  {label}: step 1 {start:.3f} {unit}, end of epoch {end:.3f} "
        f"{unit}, end/start {end / start:.2f}x")


def bench():
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  shape = _shape()
  pixels = math.prod(shape)
  large = FLAGS.large_examples or math.ceil(FLAGS.large_mib * MIB / pixels)
  small = FLAGS.small_examples or math.ceil(FLAGS.small_mib * MIB / pixels)
  batch = FLAGS.global_batch_size
  steps_per_epoch = large // batch
  if steps_per_epoch < 3 or small < batch:
    raise ConfigError(
        f"--global_batch_size={batch} is too large for {large} large / "
        f"{small} small examples (need 3 steps per epoch of the large set)")
  steps = FLAGS.train_steps or steps_per_epoch - 1
  work_dir = FLAGS.work_dir or tempfile.gettempdir()
  os.makedirs(work_dir, exist_ok=True)
  need = (large + small + 2 * FLAGS.test_examples) * pixels * 1.1 + 100 * MIB
  free = shutil.disk_usage(work_dir).free
  if free < need:
    raise ConfigError(f"--work_dir={work_dir} has {free / GIB:.1f} GiB "
                         f"free; this needs about {need / GIB:.1f} GiB")
  root = tempfile.mkdtemp(prefix="distloop_large_dataset_", dir=work_dir)
  logs = os.path.join(root, "logs")
  os.makedirs(logs)
  started = time.perf_counter()
  try:
    _measure(shape, large, small, steps, steps_per_epoch, root, logs)
  except Failed as e:
    sys.exit(f"large_dataset.py: error: {e}")
  finally:
    if FLAGS.keep:
      print(f"kept {root}")
    else:
      shutil.rmtree(root, ignore_errors=True)
      print(f"deleted {root}")
  print(f"benchmark took {time.perf_counter() - started:.0f} s")


def _measure(shape, large, small, steps, steps_per_epoch, root, logs):
  from framework.data import file_input  # pylint: disable=g-import-not-at-top
  batch = FLAGS.global_batch_size
  large_dir, large_bytes = _write("large", large, shape, root, logs)
  print(f"  larger than 2 GiB: {'yes' if large_bytes > 2 * GIB else 'NO'}")
  small_dir, _ = _write("small", small, shape, root, logs)

  def train(name, data_dir, train_steps, model_dir):
    return _run(name, "train.py", [
        "--model=mlp", f"--hidden_units={','.join(FLAGS.hidden_units)}",
        "--dataset=tfrecord", f"--data_dir={data_dir}",
        f"--global_batch_size={batch}", f"--train_steps={train_steps}",
        "--steps_per_loop=10", "--checkpoint_every=1000000000",
        "--eval_every=0", "--export_saved_model=false",
        f"--model_dir={os.path.join(root, 'runs', model_dir)}"], logs)

  # (b) The same run on both sets. The large run's final checkpoint, at the
  # epoch's last step but one, is (c)'s end-of-epoch checkpoint.
  _, small_rss, small_s = train("train_small", small_dir, steps, "small")
  _, large_rss, large_s = train("train_large", large_dir, steps, "large")
  print(f"\n(b) peak resident memory of train.py, {steps} steps of batch "
        f"{batch} ({steps * batch / large:.2f} epochs of the large set), "
        f"groups of {file_input.DEFAULT_SHARDS_PER_GROUP} shards of "
        f"{FLAGS.shard_mib:g} MiB:")
  print(f"  small set: {small_rss:,.0f} MiB  ({small_s:.0f} s)")
  print(f"  large set: {large_rss:,.0f} MiB  ({large_s:.0f} s)")
  ratio = large_rss / small_rss
  print(f"  large / small: {ratio:.2f}x  (goal <= 1.5x: "
        f"{'met' if ratio <= 1.5 else 'NOT met'})", flush=True)

  # (c) Restarts from step 1 and from the end of the epoch, one step each.
  end = steps_per_epoch - 1
  resumed = {}
  for step in (1, end):
    model_dir = "large"  # the large run's checkpoint, at step `steps`
    if step != steps:
      model_dir = f"to_step{step}"
      train(model_dir, large_dir, step, model_dir)
    text, _, seconds = train(f"resume_step{step}", large_dir, step + 1,
                             model_dir)
    resumed[step] = (_restore_to_step(text, step + 1), seconds)
  in_process, replay = _resume_in_process(large_dir, end)
  print(f"\n(c) resume latency in the large set ({steps_per_epoch} steps per "
        f"epoch; end of epoch = step {end}):")
  _ratio_line("input built at the step -> first batch (in-process, median "
              f"of {FLAGS.resume_repeats})", in_process[1], in_process[end])
  if replay is not None:
    print(f"  for reference, replaying the stream from step 0 to step {end}: "
          f"{replay:.3f} s")
  _ratio_line("train.py restart, 'Restored checkpoint' -> next step logged",
              resumed[1][0], resumed[end][0])
  _ratio_line("train.py restart, whole process", resumed[1][1],
              resumed[end][1])


main = cli.main_running(bench)

if __name__ == "__main__":
  app.run(main)
