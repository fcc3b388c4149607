"""Benchmark: a run's goodput account across one relaunch and one rollback.

    python scripts/benchmarks/goodput_relaunch.py \
        --output_json=docs/results/long_runs_goodput.json

One `scripts/launch.py --workers=2 --max_restarts=1` job of
`scripts/train.py --strategy=multi_worker_mirrored --spike_policy=rollback`
on numpy data it writes (--examples rows of --features normal features,
label: feature 0 > 0, a fifth of them flipped) in which one example, of the global batch that step
--spike_step trains on, has its features multiplied by 1e4 and its label
flipped: that step's loss spikes, the run rolls back to its last
checkpoint and skips the batches since it. Once the checkpoint of step
--kill_after is listed and worker:0 has logged --kill_later more steps,
worker:1 gets SIGKILL; the launcher stops worker:0 and relaunches both,
which resume from that checkpoint (the steps trained after it are lost)
and skip the rolled-back batches again (`spike_batches.json`).

Prints and writes `goodput.json`'s account (each part in seconds and as a
share of its wall time, their sum), the wall time measured here from the
launcher's start to its exit, and the chief's final goodput line. The
account's wall time starts when the first launch's Controller starts
(after the interpreter loaded TensorFlow and built the data) and ends at
its last record, so it is shorter than the measured one by those seconds.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from framework.app.config import ExperimentConfig  # pylint: disable=g-import-not-at-top
from framework.settings import default  # pylint: disable=g-import-not-at-top
from scripts.benchmarks import host  # pylint: disable=g-import-not-at-top

flags.DEFINE_integer("examples", 80000, "Training examples (more than "
                     "--train_steps global batches: one epoch, so the "
                     "poisoned example comes once).")
flags.DEFINE_integer("features", 64, "Features per example.")
flags.DEFINE_integer("global_batch_size",
                     default(ExperimentConfig, "global_batch_size"),
                     "--global_batch_size.")
flags.DEFINE_string("hidden_units", "512,512", "--hidden_units.")
flags.DEFINE_integer("train_steps", 600, "--train_steps.")
flags.DEFINE_integer("checkpoint_every", 100, "--checkpoint_every.")
flags.DEFINE_integer("spike_step", 250, "The step whose batch holds the "
                     "poisoned example (after --spike_window steps and the "
                     "first checkpoint).")
flags.DEFINE_integer("kill_after", 400, "SIGKILL worker:1 once this "
                     "step's checkpoint is listed and worker:0 logged "
                     "--kill_later more steps (after --spike_step).")
flags.DEFINE_integer("kill_later", 20, "Steps trained after the checkpoint "
                     "before the kill (lost: trained again).")
flags.DEFINE_string("output_json", None, "Write the raw figures here.")
FLAGS = flags.FLAGS

PYTHON = sys.executable
SEED = 0


def write_data(path):
  """The numpy data set, one example of step --spike_step's batch
  poisoned; returns that example's index."""
  from framework.data import inputs  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.normal(size=(FLAGS.examples, FLAGS.features)).astype(np.float32)
  # A fifth of the labels flipped: the loss stays near its median (a
  # converged loss near 0 would make any misclassified example a spike).
  y = ((x[:, 0] > 0) ^ (rng.random(FLAGS.examples) < 0.2)).astype(np.int32)
  # The batch step s trains on is batch s - 1 of the run's index order.
  batches = inputs._index_batches(  # pylint: disable=protected-access
      FLAGS.examples, FLAGS.global_batch_size, SEED, FLAGS.spike_step - 1)
  _, indices = next(iter(batches))
  poisoned = int(indices[0])
  # Its label flipped too: the features' sign decides the label, so a
  # scaled copy alone is classified confidently, at no loss.
  x[poisoned] *= 1e4
  y[poisoned] = 1 - y[poisoned]
  np.savez(path, x_train=x, y_train=y, x_test=x[:512] if poisoned >= 512
           else x[-512:], y_test=y[:512] if poisoned >= 512 else y[-512:])
  return poisoned


def main(argv):
  del argv
  record = dict(host=dict(cpu=host.cpu_model(), cores=os.cpu_count(),
                          load_before=host.load_average()))
  print(f"host: {record['host']['cpu']}, {os.cpu_count()} cores, "
        f"{record['host']['load_before']}", flush=True)
  work = tempfile.mkdtemp(prefix="goodput_relaunch_")
  try:
    data = os.path.join(work, "data.npz")
    poisoned = write_data(data)
    model_dir = os.path.join(work, "run")
    train = [
        PYTHON, os.path.join(ROOT, "scripts", "train.py"),
        "--strategy=multi_worker_mirrored", "--model=mlp",
        f"--hidden_units={FLAGS.hidden_units}", "--dataset=numpy",
        f"--data_dir={data}", f"--global_batch_size={FLAGS.global_batch_size}",
        f"--train_steps={FLAGS.train_steps}", "--steps_per_loop=10",
        "--log_every=10", "--summary_every=10",
        f"--checkpoint_every={FLAGS.checkpoint_every}", "--eval_every=200",
        "--spike_policy=rollback", "--spike_factor=5", "--spike_window=20",
        "--export_saved_model=false", f"--model_dir={model_dir}"]
    command = [PYTHON, os.path.join(ROOT, "scripts", "launch.py"),
               "--workers=2", "--max_restarts=1", "--grace_period=5", "--",
               *train]
    lines = []
    started = time.time()
    job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)

    def read():
      for line in job.stdout:
        lines.append(line.rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    state = os.path.join(model_dir, "checkpoint")
    killed = None
    while job.poll() is None:
      text = open(state).read() if os.path.exists(state) else ""
      steps = [int(s) for s in re.findall(r'"ckpt-(\d+)"', text)]
      logged = [int(m.group(1)) for m in (re.match(
          r"\[worker:0\].* train step (\d+)/", l) for l in lines[-50:]) if m]
      if (steps and max(steps) >= FLAGS.kill_after and logged
          and logged[-1] >= max(steps) + FLAGS.kill_later):
        pid = [int(m.group(1)) for m in (
            re.match(r"\[launch\] worker:1 pid=(\d+)", l) for l in lines)
               if m][0]
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          job.kill()
          sys.exit("goodput_relaunch.py: error: worker:1 ended before the "
                   f"checkpoint of step {FLAGS.kill_after}:\n"
                   + "\n".join(lines)[-6000:])
        killed = max(steps)
        break
      time.sleep(0.02)
    status = job.wait(timeout=1800)
    ended = time.time()
    reader.join(timeout=10)
    output = "\n".join(lines)
    if (status or killed is None
        or not any("loss spike at step" in l for l in lines)):
      sys.exit(f"goodput_relaunch.py: error: launch.py exited {status} "
               f"(killed after checkpoint {killed}; a rollback: "
               f"{any('loss spike at step' in l for l in lines)}):\n{output[-4000:]}")
    with open(os.path.join(model_dir, "goodput.json")) as f:
      goodput = json.load(f)
    with open(os.path.join(model_dir, "spike_batches.json")) as f:
      spikes = json.load(f)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  account = goodput["account"]
  wall = account["wall"]
  parts = {k: v for k, v in account.items() if k != "wall"}
  lines = [l.replace(work, "$WORK") for l in lines]
  record.update(
      command=" ".join(["python"] + command[1:]).replace(
          work, "$WORK").replace(PYTHON, "python").replace(ROOT + "/", ""),
      poisoned_example=poisoned, killed_after_checkpoint=killed,
      measured_wall=round(ended - started, 2), account=account,
      sum_of_parts=sum(parts.values()),
      lost_step_counts=goodput["lost_step_counts"],
      launches=goodput["launches"], spike_batches=spikes,
      rollback_lines=[l for l in lines if "loss spike at step" in l],
      launcher_lines=[l for l in lines if l.startswith("[launch]")],
      goodput_line=[l for l in lines if "] goodput " in l][-1],
      load_after=host.load_average())
  print(f"{'part':<14}{'seconds':>10}{'share':>9}  steps")
  for part, seconds in parts.items():
    print(f"{part:<14}{seconds:>10.2f}{100 * seconds / wall:>8.1f}%  "
          f"{goodput['lost_step_counts'].get(part, '')}")
  print(f"{'sum':<14}{record['sum_of_parts']:>10.2f}   account wall "
        f"{wall:.2f} s; measured wall {record['measured_wall']:.2f} s")
  for line in (record["rollback_lines"] + record["launcher_lines"]
               + [record["goodput_line"]]):
    print(line)
  print(record["load_after"])
  if FLAGS.output_json:
    with open(FLAGS.output_json, "w") as f:
      json.dump(record, f, indent=1)


if __name__ == "__main__":
  app.run(main)
