"""Examples/s of 2 single-core worker processes vs 1 process on 2 cores.

    python scripts/benchmarks/multi_worker.py [--model=cifar_cnn]
        [--global_batch_size=128] [--train_steps=60]

Runs the same model, global batch and steps three ways, on CPU cores 0 and 1:
  1. one process, default strategy, both cores (`taskset -c 0,1`);
  2. one process, `--strategy=mirrored --cpu_devices=2`, both cores;
  3. two MultiWorkerMirroredStrategy workers over loopback, one core each
     (`taskset -c 0` and `taskset -c 1`);
  4. where the difference goes: one process on one core (`taskset -c 0`,
     one thread) training one worker's share (half the global batch) alone,
     so no communication. Twice its rate is what 2 workers would reach if
     their all-reduce and lock-step cost nothing: 3 / (2 x 4) is the
     communication efficiency, and (2 x 4) / 1 how 2 one-core halves
     compare with one process's 2 cores on the whole batch (kernel scaling).
`--extra` adds train.py flags to every run (e.g. --extra=--onednn=on).
It prints the examples/s of each (steady state: the first loop, which
traces the step, is left out; best of --repeats interleaved runs) and the
ratio of 3 to each baseline. The goal
is a ratio of at least 0.8. Other load on those cores skews every figure.
"""

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

from framework.app.config import ExperimentConfig  # pylint: disable=g-import-not-at-top
from framework.distribute import launcher  # pylint: disable=g-import-not-at-top
from framework.settings import default  # pylint: disable=g-import-not-at-top
from scripts.benchmarks import host  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_string("model", default(ExperimentConfig, "model"),
                    "Model name.")
flags.DEFINE_integer("global_batch_size",
                     default(ExperimentConfig, "global_batch_size"),
                     "Examples per step, all workers together.")
flags.DEFINE_integer("train_steps", 60, "Steps per run.")
flags.DEFINE_integer("steps_per_loop", 10, "Steps per tf.function call.")
flags.DEFINE_string("cores", host.PINNED_CORES, "The two CPU cores to use.")
flags.DEFINE_multi_string("extra", [], "One more train.py flag for every "
                          "run, repeatable.")
flags.DEFINE_integer("repeats", 2, "Runs of each setup, interleaved; the "
                     "best of each counts (other load only slows runs).")

_RATE = re.compile(r"train step (\d+)/\d+: .* examples/s=([\d.]+)")
TRAIN = [sys.executable, os.path.join(_ROOT, "scripts", "train.py")]


def _train_flags(model_dir, global_batch_size=None):
  return [f"--model={FLAGS.model}", "--dataset=synthetic",
          f"--global_batch_size={global_batch_size or FLAGS.global_batch_size}",
          f"--train_steps={FLAGS.train_steps}",
          f"--steps_per_loop={FLAGS.steps_per_loop}",
          f"--log_every={FLAGS.steps_per_loop}", "--checkpoint_every=0",
          f"--model_dir={model_dir}", *FLAGS.extra]


def _env(threads, **extra):
  return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
              TF_NUM_INTRAOP_THREADS=str(threads),
              TF_NUM_INTEROP_THREADS=str(threads), **extra)


def _steady_rate(log):
  """Median examples/s of the logged loops, the first (tracing) one left out."""
  rates = [float(rate) for step, rate in _RATE.findall(log)
           if int(step) > FLAGS.steps_per_loop]
  if not rates:
    raise RuntimeError("no progress lines in the log:\n" + log[-3000:])
  return statistics.median(rates)


def _single_process(workdir, name, strategy_flags, *, cores=None, threads=2,
                    global_batch_size=None):
  proc = subprocess.run(
      ["taskset", "-c", cores or FLAGS.cores] + TRAIN + strategy_flags +
      _train_flags(os.path.join(workdir, name), global_batch_size),
      env=_env(threads), capture_output=True, text=True, check=False)
  if proc.returncode:
    raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
  return _steady_rate(proc.stderr)


def _two_workers(workdir, name):
  cluster = launcher.local_cluster(2)
  model_dir = os.path.join(workdir, name)
  processes = []
  for index, core in enumerate(FLAGS.cores.split(",")):
    env = _env(1, TF_CONFIG=launcher.tf_config(cluster, "worker", index))
    processes.append(subprocess.Popen(
        ["taskset", "-c", core] + TRAIN +
        ["--strategy=multi_worker_mirrored"] + _train_flags(model_dir),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True))
  logs = [p.communicate()[1] for p in processes]
  if any(p.returncode for p in processes):
    raise RuntimeError("a worker failed:\n" + logs[0][-3000:])
  return _steady_rate(logs[0])


def main(argv):
  del argv
  workdir = tempfile.mkdtemp(prefix="distloop_bench_")
  runs = {"default": [], "mirrored": [], "workers": [], "one_core": []}
  try:
    for i in range(FLAGS.repeats):
      runs["default"].append(_single_process(
          workdir, f"default{i}", ["--strategy=default"]))
      runs["mirrored"].append(_single_process(
          workdir, f"mirrored{i}", ["--strategy=mirrored", "--cpu_devices=2"]))
      runs["workers"].append(_two_workers(workdir, f"workers{i}"))
      runs["one_core"].append(_single_process(
          workdir, f"one_core{i}", ["--strategy=default"],
          cores=FLAGS.cores.split(",")[0], threads=1,
          global_batch_size=FLAGS.global_batch_size // 2))
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  for name, rates in runs.items():
    print(f"{name}: " + ", ".join(f"{r:.1f}" for r in rates) + " examples/s")
  default, mirrored, workers, one_core = (max(runs[k]) for k in runs)
  print(f"model={FLAGS.model} global_batch_size={FLAGS.global_batch_size} "
        f"steps={FLAGS.train_steps} cores={FLAGS.cores}")
  print(f"1 process, 2 cores, default strategy:   {default:9.1f} examples/s")
  print(f"1 process, 2 cores, mirrored (2 CPUs):  {mirrored:9.1f} examples/s")
  print(f"2 workers, 1 core each (MWMS, loopback): {workers:9.1f} examples/s")
  print(f"ratio 2 workers / 1 process (default):  {workers / default:.2f}")
  print(f"ratio 2 workers / 1 process (mirrored): {workers / mirrored:.2f}")
  print(f"where the difference goes: 1 core alone, half the batch: "
        f"{one_core:.1f} examples/s; 2 x that = {2 * one_core:.1f}")
  print(f"  communication efficiency 2 workers / (2 x 1 core alone): "
        f"{workers / (2 * one_core):.2f}")
  print(f"  kernel scaling (2 x 1 core alone) / 1 process on 2 cores: "
        f"{2 * one_core / default:.2f}")


if __name__ == "__main__":
  app.run(main)
