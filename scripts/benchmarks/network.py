"""Training over links of a given bandwidth: each task on its own "host".

    sudo python scripts/benchmarks/network.py [--rates=unshaped,25gbit,10gbit,1gbit]
        [--modes=mwms,ps,split] [--knobs] [--model=cifar_cnn] [--train_steps=40]

Every task runs in its own network namespace with its own address, joined to
the others by veth pairs through a bridge (`framework.distribute.netns`,
the same as `launch.py --netns`); with a rate, each link is shaped in both
directions by `tc` (tbf; no added delay). Modes:
  mwms:  2 MultiWorkerMirrored workers, one core each (taskset);
  ps:    parameter server: chief + 2 workers + 1 ps;
  split: the 5 + 5 tensor split of the MLP's 10 hidden units over 2 worker
         hosts (`--model_parallel_devices=cluster`, chief runs the loop).
`--knobs` adds, at each of --knob_rates (10gbit), MWMS with
--all_reduce_dtype=bfloat16, with --all_reduce_bytes_per_pack=1048576, with
--all_reduce_overlap, and with overlap and bfloat16 together. A compute-only
baseline (the 2 workers' half batches trained at once, each in its own
process on its worker's core, no network: two independent halves;
`--halves=alone`: one half alone, counted twice) runs before the first run
and after each MWMS run; an MWMS run's "vs halves" divides its examples/s
by the mean of the two baselines around it.

First, per rate, one plain TCP stream between two hosts (--socket_seconds):
what the link carries without TensorFlow. For each run it prints examples/s and the bytes on the wire per step (the
sum of every host interface's tx counter), both between the chief's log
lines at steps --measure_from and --train_steps (tracing and start-up left
out). Prints one line and exits 0 where namespaces or tc are missing. Not a
test: it needs root, and other load on the machine skews every figure.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

from framework.app.config import ExperimentConfig  # pylint: disable=g-import-not-at-top
from framework.distribute import launcher  # pylint: disable=g-import-not-at-top
from framework.distribute import netns  # pylint: disable=g-import-not-at-top
from framework.distribute.config import LaunchConfig  # pylint: disable=g-import-not-at-top
from framework.perf import allocator  # pylint: disable=g-import-not-at-top
from framework.settings import default  # pylint: disable=g-import-not-at-top
from scripts.benchmarks import host  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_list("rates", ["unshaped", "25gbit", "10gbit", "1gbit"],
                  "Link bandwidths ('unshaped': no tc).")
flags.DEFINE_list("modes", ["mwms", "ps", "split"], "mwms, ps, split "
                  "(empty: only the socket probe).")
flags.register_validator(
    "modes", lambda v: set(v) <= {"mwms", "ps", "split"},
    "each of --modes must be mwms, ps or split")
flags.DEFINE_bool("knobs", True, "Also MWMS at --knob_rates with bfloat16 "
                  "reduction, with 1 MiB packs, with overlap, and with "
                  "overlap and bfloat16.")
flags.DEFINE_string("model", default(ExperimentConfig, "model"),
                    "Model for mwms and ps.")
flags.DEFINE_integer("global_batch_size",
                     default(ExperimentConfig, "global_batch_size"),
                     "Examples per step.")
flags.DEFINE_integer("train_steps", 40, "Steps per run.")
flags.DEFINE_integer("measure_from", 10, "First logged step of the window "
                     "(the loops before it trace and warm up).")
flags.DEFINE_integer("steps_per_loop", 5, "Steps per tf.function call.")
flags.DEFINE_list("knob_rates", ["10gbit"], "Rates of the --knobs runs.")
flags.DEFINE_integer("mtu", default(LaunchConfig, "netns_mtu"),
                     "Every link's MTU (9000: jumbo frames).")
flags.DEFINE_enum("malloc", allocator.DEFAULT_ALLOCATOR,
                  list(allocator.ALLOCATORS),
                  "train.py --malloc of every run and the baseline.")
flags.DEFINE_multi_string("extra", [], "One more train.py flag for the mwms "
                          "and ps runs and the baseline, repeatable (e.g. "
                          "--extra=--hidden_units=1024,1024).")
flags.DEFINE_enum("halves", "together", ["together", "alone"],
                  "The compute-only baseline: the 2 workers' half batches "
                  "trained at once, each on its worker's core, with no "
                  "network (together), or one half alone on one core, "
                  "counted twice (alone: the figures before 2026-12-02).")
flags.DEFINE_float("socket_seconds", 3.0, "Before the runs, one TCP stream "
                   "between 2 hosts for this long at each rate: what the "
                   "link itself carries, without TensorFlow (0: skip).",
                   lower_bound=0)
flags.DEFINE_string("cores", host.PINNED_CORES, "CPU cores; task i is "
                    "pinned to core i mod len (taskset), one thread each.")
flags.DEFINE_integer("inter_op_threads", 1, "TF_NUM_INTEROP_THREADS of every "
                     "task and of the baseline: with 1 a worker's collectives "
                     "and its compute take turns on one thread; more lets "
                     "them overlap on the core (parameter-server workers "
                     "take 2 whatever this says).", lower_bound=1)

TRAIN = [sys.executable, os.path.join(_ROOT, "scripts", "train.py")]
_STEP = re.compile(r"^\[(chief|worker):0\] .*train step (\d+)/\d+:")


class _Window:
  """A launcher output sink: times and counters at two logged steps."""

  def __init__(self, first, last, counters):
    self.first, self.last, self.counters = first, last, counters
    self.marks = {}
    self.tail = []
    self._lock = threading.Lock()

  def write(self, text):
    with self._lock:
      for line in text.splitlines():
        self.tail = (self.tail + [line])[-40:]
        match = _STEP.match(line)
        if match and int(match.group(2)) in (self.first, self.last):
          self.marks.setdefault(int(match.group(2)),
                                (time.monotonic(), self.counters()))

  def flush(self):
    pass

  def result(self):
    if len(self.marks) != 2:
      raise RuntimeError("no progress lines:\n" + "\n".join(self.tail))
    (t0, c0), (t1, c1) = self.marks[self.first], self.marks[self.last]
    steps = self.last - self.first
    tx = sum(c1[h][1] - c0[h][1] for h in c0)
    return steps * FLAGS.global_batch_size / (t1 - t0), tx / steps, (
        t1 - t0) / steps


def _train_flags(model_dir, *extra):
  return [f"--global_batch_size={FLAGS.global_batch_size}",
          "--dataset=synthetic", f"--train_steps={FLAGS.train_steps}",
          f"--steps_per_loop={FLAGS.steps_per_loop}",
          f"--log_every={FLAGS.steps_per_loop}", "--checkpoint_every=0",
          "--eval_every=0", "--export_saved_model=false",
          f"--model_dir={model_dir}", f"--malloc={FLAGS.malloc}", *extra]


def _command(mode, model_dir, extra):
  if mode == "split":
    return TRAIN + _train_flags(
        model_dir, "--model=mlp", "--hidden_units=10",
        "--model_parallel=tensor", "--num_shards=2",
        "--model_parallel_devices=cluster", *extra)
  strategy = "parameter_server" if mode == "ps" else "multi_worker_mirrored"
  return TRAIN + _train_flags(model_dir, f"--model={FLAGS.model}",
                              f"--strategy={strategy}", *FLAGS.extra, *extra)


def _env():
  return dict(TF_CPP_MIN_LOG_LEVEL="2", TF_NUM_INTRAOP_THREADS="1",
              TF_NUM_INTEROP_THREADS=str(FLAGS.inter_op_threads))


def run_on_hosts(mode, rate, workdir, extra=()):
  """(examples/s, wire bytes per step, seconds per step) of one run."""
  ps = 1 if mode == "ps" else 0
  chief = mode in ("ps", "split")
  hosts = 2 + ps + int(chief)
  cores = FLAGS.cores.split(",")
  name = f"{mode}_{rate}_{len(os.listdir(workdir))}"
  with netns.HostNetwork(hosts, rate=None if rate == "unshaped" else rate,
                         name="dlb", mtu=FLAGS.mtu) as net:
    cluster = launcher.cluster_on_hosts(net.addresses, 2, ps, chief=chief)
    order = {task: i for i, task in enumerate(launcher.tasks_of(cluster))}
    window = _Window(FLAGS.measure_from, FLAGS.train_steps, net.counters)
    job = launcher.Launcher(
        _command(mode, os.path.join(workdir, name), extra), cluster,
        grace_period=2, env=_env(), output=window,
        serving_workers=mode == "split",
        task_prefix=lambda role, index: net.prefix(order[(role, index)]) + [
            "taskset", "-c", cores[order[(role, index)] % len(cores)]])
    status = job.run()
  if status:
    raise RuntimeError(f"{mode} at {rate} exited {status}:\n"
                       + "\n".join(window.tail))
  return window.result()


_RECEIVE = """
import socket, sys
server = socket.create_server((sys.argv[1], 5555))
print("ready", flush=True)
conn, _ = server.accept()
view = memoryview(bytearray(1 << 20))
while conn.recv_into(view):
  pass
"""
_SEND = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], 5555))
data, sent, start = b"x" * (1 << 20), 0, time.perf_counter()
while time.perf_counter() - start < float(sys.argv[2]):
  conn.sendall(data)
  sent += len(data)
conn.close()
print(sent * 8 / (time.perf_counter() - start) / 1e9)
"""


def socket_gbits(rate):
  """Gbit/s of one TCP stream from host 1 to host 0 over `rate`'s links."""
  with netns.HostNetwork(2, rate=None if rate == "unshaped" else rate,
                         name="dlb", mtu=FLAGS.mtu) as net:
    receiver = subprocess.Popen(
        net.prefix(0) + [sys.executable, "-c", _RECEIVE, net.addresses[0]],
        stdout=subprocess.PIPE, text=True)
    try:
      receiver.stdout.readline()
      sender = subprocess.run(
          net.prefix(1) + [sys.executable, "-c", _SEND, net.addresses[0],
                           str(FLAGS.socket_seconds)],
          capture_output=True, text=True, check=True)
    finally:
      receiver.wait(timeout=30)
  return float(sender.stdout)


def compute_only(workdir):
  """(examples/s, seconds per step) of the 2 workers' half batches trained
  with no network: both at once, each on its worker's core (--halves=
  together), or one alone on one core, counted twice (--halves=alone)."""
  half = FLAGS.global_batch_size // 2
  cores = FLAGS.cores.split(",")
  count = 2 if FLAGS.halves == "together" else 1
  procs = []
  for i in range(count):
    model_dir = os.path.join(workdir, f"halves_{len(os.listdir(workdir))}")
    os.makedirs(model_dir)
    args = _train_flags(model_dir, f"--model={FLAGS.model}",
                        "--strategy=default", *FLAGS.extra)
    args[0] = f"--global_batch_size={half}"
    procs.append(subprocess.Popen(
        ["taskset", "-c", cores[i % len(cores)]] + TRAIN + args,
        env=dict(os.environ, **_env()), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True))
  per_steps = []
  for proc in procs:
    _, stderr = proc.communicate()
    times = {}
    for line in stderr.splitlines():
      match = re.search(r"train step (\d+)/\d+:", line)
      if match:
        times[int(match.group(1))] = line
    if proc.returncode or FLAGS.measure_from not in times:
      raise RuntimeError("compute-only run failed:\n" + stderr[-3000:])
    rates = [float(m) for s, l in times.items() if s > FLAGS.measure_from
             for m in re.findall(r"examples/s=([\d.]+)", l)]
    per_steps.append(half / (sum(rates) / len(rates)))
  rates = [half / t for t in per_steps]  # examples/s of each half
  return sum(rates) * 2 / count, sum(per_steps) / count


def main(argv):
  del argv
  reason = netns.missing()
  if reason:
    print(f"network.py: skipped: {reason}")
    return
  workdir = tempfile.mkdtemp(prefix="distloop_net_")
  runs = [(mode, rate, ()) for mode in FLAGS.modes for rate in FLAGS.rates]
  if FLAGS.knobs and "mwms" in FLAGS.modes:
    runs += [("mwms", rate, knob) for rate in FLAGS.knob_rates for knob in (
        ("--all_reduce_dtype=bfloat16",),
        ("--all_reduce_bytes_per_pack=1048576",),
        ("--all_reduce_overlap",),
        ("--all_reduce_overlap", "--all_reduce_dtype=bfloat16"))]
  print(f"model={FLAGS.model} {' '.join(FLAGS.extra)} (split: mlp 5+5) "
        f"global_batch_size="
        f"{FLAGS.global_batch_size} steps {FLAGS.measure_from}.."
        f"{FLAGS.train_steps} cores={FLAGS.cores} "
        f"inter_op_threads={FLAGS.inter_op_threads} malloc={FLAGS.malloc} "
        f"mtu={FLAGS.mtu}",
        flush=True)
  try:
    if FLAGS.socket_seconds:
      for rate in dict.fromkeys(FLAGS.rates + (
          FLAGS.knob_rates if FLAGS.knobs else [])):
        print(f"socket {rate:9s} one TCP stream: {socket_gbits(rate):.1f} "
              "Gbit/s", flush=True)
    baselines = []

    def baseline():
      rate, per_step = compute_only(workdir)
      baselines.append(rate)
      how = ("2 halves at once, one core each" if FLAGS.halves == "together"
             else "2 x one core alone")
      print(f"compute only ({how}, half batch each): "
            f"{rate:.1f} examples/s, {per_step * 1e3:.1f} ms/step",
            flush=True)

    # A baseline before the first run and after each MWMS run: a shared or
    # throttled host drifts by more than the knobs differ, so each MWMS run
    # is set against the mean of the two baselines around it.
    if "mwms" in FLAGS.modes:
      baseline()
    for mode, rate, extra in runs:
      try:
        examples, wire, per_step = run_on_hosts(mode, rate, workdir, extra)
        line = (f"{mode:5s} {rate:9s} {' '.join(extra) or '-':38s} "
                f"{examples:8.1f} examples/s {per_step * 1e3:8.1f} ms/step "
                f"{wire / 1e6:8.2f} MB/step on the wire")
      except RuntimeError as e:
        examples, line = None, (f"{mode:5s} {rate:9s} "
                                f"{' '.join(extra) or '-':38s} failed: "
                                f"{str(e)[-600:]}")
      if mode == "mwms":
        baseline()
        if examples is not None:
          halves = (baselines[-2] + baselines[-1]) / 2
          line += f"  vs halves {examples / halves:.2f}"
      print(line, flush=True)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
