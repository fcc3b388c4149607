"""Benchmark: ZeRO-1's reduce-scatter, its sums and its bytes on the wire.

    python scripts/benchmarks/reduce_scatter.py --check   # sums: 1 and 2 processes
    sudo python scripts/benchmarks/reduce_scatter.py      # + bytes per step

`--check`: `framework.distribute.collectives.ReduceScatter` (an all-to-all
and a local sum) against the all-reduce's matching rows, for tensors of a
few shapes and two dtypes, under MirroredStrategy on 2 logical CPU devices
(this process) and under MultiWorkerMirroredStrategy across 2 processes on
127.0.0.1; prints the largest |difference| of each.

Bytes (needs root: each worker on a network namespace of its own,
`framework.distribute.netns`, so only its traffic is counted): 2 workers
train the MLP (`--hidden_units=512,512`, 1.84 M float32 parameters) with
`--shard_optimizer_state` for --short and --long steps, with the
reduce-scatter and with the all-reduce (selected by a non-default
`--all_reduce_bytes_per_pack` that packs everything in one, as the
default does); bytes per step = the difference of the two runs' summed tx
counters over the difference of their steps (start-up, checkpoints and
the final evaluation cancel out). Beside it the formula: per device a ring
all-reduce sends 2(N-1)/N x S bytes, a ring all-gather and a pairwise
all-to-all (N-1)/N x S, for S the bytes of the padded gradient.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_bool("check", False, "Only compare the sums (no root needed).")
flags.DEFINE_integer("short", 10, "Steps of the shorter run.")
flags.DEFINE_integer("long", 40, "Steps of the longer run.")
flags.DEFINE_string("worker", None, "Internal: run the check as this "
                    "MultiWorkerMirrored worker (TF_CONFIG set).")
TRAIN = [sys.executable, os.path.join(_ROOT, "scripts", "train.py")]
MLP = ["--model=mlp", "--dataset=synthetic", "--hidden_units=512,512",
       "--global_batch_size=64", "--optimizer=adam",
       "--strategy=multi_worker_mirrored", "--shard_optimizer_state",
       "--steps_per_loop=5", "--log_every=5", "--summary_every=1000",
       "--checkpoint_every=1000"]
PATHS = {"reduce-scatter + all-gather": [],
         "all-reduce + all-gather": ["--all_reduce_bytes_per_pack=1073741824"]}


def max_difference(strategy):
  """Largest |reduce-scatter - all-reduce row| over a few shapes."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework.distribute import collectives  # pylint: disable=g-import-not-at-top
  n = strategy.num_replicas_in_sync
  scatter = collectives.ReduceScatter(strategy)
  widths = (1, 7, 1000, 65536)

  @tf.function
  def step(seed):
    def replica_fn():
      context = tf.distribute.get_replica_context()
      r = context.replica_id_in_sync_group
      values = [tf.random.stateless_normal([n, w], seed=[seed, r * 10 + i])
                for i, w in enumerate(widths)]
      values.append(tf.cast(values[1] * 100., tf.bfloat16))
      mine = scatter(values[:-1]) + [scatter(values[-1])]
      total = [context.all_reduce(tf.distribute.ReduceOp.SUM, v)
               for v in values]
      return tf.reduce_max([tf.reduce_max(tf.abs(tf.cast(a - b[r], tf.float32)))
                            for a, b in zip(mine, total)])
    return strategy.experimental_local_results(strategy.run(replica_fn))

  return max(float(d) for seed in range(3) for d in step(seed))


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def check():
  """The sums on 2 logical devices here and across 2 processes."""
  import framework  # pylint: disable=g-import-not-at-top
  framework.configure_cpu_devices(2)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  mirrored = max_difference(tf.distribute.MirroredStrategy(
      ["/cpu:0", "/cpu:1"]))
  print(f"mirrored, 2 logical CPU devices: max |diff| {mirrored:.3g}")
  cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
  procs = [subprocess.Popen(
      [sys.executable, __file__, f"--worker={i}"], stdout=subprocess.PIPE,
      text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                          TF_CONFIG=json.dumps({"cluster": cluster, "task": {
                              "type": "worker", "index": i}})))
           for i in range(2)]
  outputs = [p.communicate(timeout=600)[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outputs)):
    print(f"multi_worker_mirrored, worker {i} of 2 processes: "
          f"{out.strip()} (exit {p.returncode})")
  return max(mirrored, *(float(o.split()[-1]) for o in outputs))


def formula(parameters, n=2):
  """Bytes each device sends per step (float32, padded to N shards)."""
  padded = -(-parameters // n) * n * 4
  part = (n - 1) / n * padded
  return {"all-reduce + all-gather": 3 * part,
          "reduce-scatter + all-gather": 2 * part}


def wire_bytes(flags_, steps, net, workdir):
  """Summed tx bytes of both hosts for a run of `steps` steps."""
  from framework.distribute import launcher  # pylint: disable=g-import-not-at-top
  cluster = launcher.cluster_on_hosts(net.addresses, 2, 0, chief=False)
  order = {task: i for i, task in enumerate(launcher.tasks_of(cluster))}
  model_dir = tempfile.mkdtemp(dir=workdir)
  log = open(os.path.join(workdir, "log.txt"), "a")
  before = net.counters()
  job = launcher.Launcher(
      TRAIN + MLP + flags_ + [f"--train_steps={steps}",
                              f"--model_dir={model_dir}"],
      cluster, grace_period=2, output=log,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
      task_prefix=lambda role, index: net.prefix(order[(role, index)]))
  status = job.run()
  log.close()
  if status:
    raise RuntimeError(f"exit {status}: {open(log.name).read()[-2000:]}")
  after = net.counters()
  return sum(after[h][1] - before[h][1] for h in after)


def main(argv):
  del argv
  if FLAGS.worker is not None:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    print(f"max |diff| {max_difference(tf.distribute.MultiWorkerMirroredStrategy()):.3g}")
    return
  worst = check()
  print(f"largest |reduce-scatter - all-reduce|: {worst:.3g}")
  if FLAGS.check:
    return
  from framework.distribute import netns  # pylint: disable=g-import-not-at-top
  reason = netns.missing()
  if reason:
    print(f"bytes on the wire: skipped ({reason})")
    return
  parameters = 3072 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
  expected = formula(parameters)
  print(f"MLP 512x512: {parameters} parameters, 2 workers")
  print("| path | formula (bytes sent per device per step) | measured "
        "(tx per host per step, gRPC included) |")
  print("|---|---|---|")
  with tempfile.TemporaryDirectory() as workdir, netns.HostNetwork(
      2, name="dlrs") as net:
    for name, extra in PATHS.items():
      short = wire_bytes(extra, FLAGS.short, net, workdir)
      long = wire_bytes(extra, FLAGS.long, net, workdir)
      per_step = (long - short) / (FLAGS.long - FLAGS.short) / 2
      print(f"| {name} | {expected[name] / 1e6:.2f} MB | "
            f"{per_step / 1e6:.2f} MB |", flush=True)


if __name__ == "__main__":
  app.run(main)
