"""Seconds from SIGTERM to "checkpoint saved" and to process exit.

Starts scripts/train.py on the README's main command shape (cifar_cnn,
mirrored on 2 CPU devices, global batch 256, 100 steps per loop), waits
until the first loop has ended and `--delay` seconds more (so that the
signal lands inside a loop), sends SIGTERM and prints the figures:

    python scripts/benchmarks/preemption_latency.py \
        --data_dir=../shared/data/cifar10/cifar-10-batches-py

`--repo` runs another checkout's train.py (e.g. an older commit, for a
before/after comparison).
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from framework.core.config import LoopConfig  # pylint: disable=g-import-not-at-top
from framework.settings import default  # pylint: disable=g-import-not-at-top

flags.DEFINE_string("repo", ROOT, "Checkout whose scripts/train.py to run.")
flags.DEFINE_string("data_dir", os.path.join(
    ROOT, "..", "shared", "data", "cifar10", "cifar-10-batches-py"),
                    "CIFAR-10 python directory.")
flags.DEFINE_integer("steps_per_loop", default(LoopConfig, "steps_per_loop"),
                     "--steps_per_loop of the run.")
flags.DEFINE_integer("global_batch_size", 256, "--global_batch_size.")
flags.DEFINE_float("delay", 3.0, "Seconds after the first loop's log line "
                   "before the SIGTERM.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  model_dir = tempfile.mkdtemp(prefix="preemption_latency_")
  command = [
      sys.executable, os.path.join(FLAGS.repo, "scripts", "train.py"),
      "--model=cifar_cnn", f"--data_dir={FLAGS.data_dir}",
      "--strategy=mirrored", "--cpu_devices=2",
      f"--global_batch_size={FLAGS.global_batch_size}",
      f"--steps_per_loop={FLAGS.steps_per_loop}",
      f"--log_every={FLAGS.steps_per_loop}", "--train_steps=100000",
      "--checkpoint_every=0", f"--model_dir={model_dir}"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=FLAGS.repo)
  process = subprocess.Popen(command, cwd=FLAGS.repo, env=env,
                             stderr=subprocess.PIPE, text=True)
  lines = []  # (monotonic time, line)
  first_loop = threading.Event()

  def read():
    for line in process.stderr:
      lines.append((time.monotonic(), line.rstrip()))
      if "train step" in line:
        first_loop.set()

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  if not first_loop.wait(timeout=900):
    process.kill()
    sys.exit("no training loop finished in 900 s:\n" +
             "\n".join(l for _, l in lines[-20:]))
  rate = re.search(r"examples/s=([\d.]+)", [
      l for _, l in lines if "train step" in l][0])
  step_seconds = FLAGS.global_batch_size / float(rate.group(1))
  time.sleep(FLAGS.delay)
  sent = time.monotonic()
  process.send_signal(signal.SIGTERM)
  status = process.wait(timeout=900)
  exited = time.monotonic()
  reader.join(timeout=10)
  saved = [(t, l) for t, l in lines if "Saved checkpoint" in l]
  preempted = [l for _, l in lines if "Preempted" in l]
  saved_at = saved[-1][0] - sent if saved else float("nan")
  print(f"repo: {FLAGS.repo}")
  print(f"one step: {step_seconds:.2f} s (first loop's examples/s)")
  print(f"SIGTERM -> checkpoint saved: {saved_at:.1f} s")
  print(f"SIGTERM -> process exited:   {exited - sent:.1f} s "
        f"(status {status})")
  print(preempted[-1] if preempted else "no 'Preempted' line")


if __name__ == "__main__":
  app.run(main)
