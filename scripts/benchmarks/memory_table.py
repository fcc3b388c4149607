"""Benchmark: the GPT's bytes per device, bytes on the wire and tokens/s per
sharding (data parallel, ZeRO-1, ZeRO-2, ZeRO-3, a tensor-split mesh), each
with and without activation recomputation.

    sudo python scripts/benchmarks/memory_table.py --json=docs/results/memory_table.json
    python scripts/benchmarks/memory_table.py --check   # counts only, 1 process

Each row of `CONFIGS` (name -> `train.py` flags) x `--recompute` trains the
GPT of each size of `SIZES` with `train.py`'s own code path on 2
MultiWorkerMirrored worker processes (`framework.distribute.launcher`),
each on a network namespace of its own when this runs as root
(`framework.distribute.netns`). The mesh `data:2,model:2` runs twice: as
one process on 4 logical CPU devices (`--cpu_devices=4`), and over a
cluster (`--model_parallel_devices=cluster`): a chief that runs the loop
and 2 worker processes of 2 logical CPU devices each, copy r of the split
on worker r (the data axis across the processes, the model axis within
one), each task on a namespace of its own. Each process is this script
with `--record=FOLDER`: `train.py`'s run, its trainer instrumented as it is
built, and writes what it saw (a serving worker of the cluster mesh: its
resident memory, sampled):

- per device, counted from what the run holds: the weights' and the
  optimizer slots' copies on this worker's device (their own shapes and
  dtypes), and the gradient held across the micro-batches and handed on
  (the accumulator's static shapes, while the step is traced); beside them
  the counts by hand from the parameter count (P, N = 2 replicas, float32,
  each sharded variable padded to a multiple of N);
- peak activations: the process's peak resident memory (`ru_maxrss`) after
  the last step minus that when the trainer was built (CPU devices keep no
  allocator statistics; `scripts/benchmarks/recompute_memory.py`); for the
  cluster mesh each worker's peak minus its resident memory when the
  chief's trainer was built (the workers hold the devices);
- bytes on the wire: the summed tx counters of the workers' namespaces over
  a `--long` and a `--short` run, their difference over the steps'
  difference, per host (start-up, checkpoints and the final evaluation
  cancel out); the cluster mesh's chief's tx beside it;
- tokens/s: global_batch_size x sequence_length over the median step time
  of the long run (each step one `trainer.train` call, `--steps_per_loop=1`,
  timed around the call; the first 2 steps, traced, left out); the median
  over the 2 workers.

Rows whose flags `train.py` does not define (ZeRO-3's `--shard_parameters`
before it is built) print "not built". `--check` runs data parallel, ZeRO-1
and ZeRO-2 (and ZeRO-3 once built) of a tiny GPT in this process on 2
mirrored logical CPU devices and exits 1 unless every counted byte equals
the count by hand.
"""

import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position

from distloop_cli import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from distloop_cli import train  # pylint: disable=g-import-not-at-top,wrong-import-position  (train.py's flags: the worker runs it)
from scripts.benchmarks import host  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["small", "medium"], "GPT sizes (see SIZES).")
flags.DEFINE_list("configs", None, "Rows of CONFIGS to run (default all).")
flags.DEFINE_list("recompute_values", ["none", "blocks"],
                  "--recompute values, each row once with each.")
flags.DEFINE_integer("short", 4, "Steps of the shorter run.")
flags.DEFINE_integer("long", 14, "Steps of the longer run.")
flags.DEFINE_bool("check", False, "Only the counts of a tiny GPT on 2 "
                  "mirrored logical CPU devices, in this process; exit 1 "
                  "unless counted and by-hand bytes agree.")
flags.DEFINE_string("json", "", "Write the results here too.")
flags.DEFINE_string("record", None, "Internal: run train.py with these "
                    "flags and write what the run held into this folder.")

N = 2  # replicas (worker processes, or the mesh's data axis)
# name -> train.py flags. A row is one line; rows whose flags train.py
# lacks print "not built".
CONFIGS = {
    "data parallel": [],
    "ZeRO-1": ["--shard_optimizer_state"],
    "ZeRO-2": ["--shard_optimizer_state", "--shard_gradients"],
    "ZeRO-3": ["--shard_optimizer_state", "--shard_gradients",
               "--shard_parameters"],
    "mesh data:2 x model:2 (1 process)": [
        "--mesh=data:2,model:2", "--cpu_devices=4", "--grad_accum_steps=1",
        "--strategy=default"],
    # Copy r on worker r: the model axis's all-reduces (two per block and
    # pass) stay in a process, the data axis's gradient all-reduce crosses.
    "mesh data:2 x model:2 (2 processes)": [
        "--mesh=data:2,model:2", "--model_parallel_devices=cluster",
        "--cpu_devices=2", "--grad_accum_steps=1", "--strategy=default"],
}
MESH = "mesh data:2 x model:2 (1 process)"
MESH_CLUSTER = "mesh data:2 x model:2 (2 processes)"
MESHES = (MESH, MESH_CLUSTER)
RSS_SAMPLE_S = 0.2  # a serving worker's resident-memory sampling period
SIZES = {
    "tiny": dict(model_width=16, num_layers=1, num_heads=2,
                 sequence_length=16, global_batch_size=4),
    "small": dict(model_width=128, num_layers=2, num_heads=4,
                  sequence_length=128, global_batch_size=8),
    "medium": dict(model_width=256, num_layers=4, num_heads=4,
                   sequence_length=256, global_batch_size=8),
}
COMMON = ["--model=gpt", "--dataset=text", "--optimizer=adam",
          "--learning_rate=1e-3", "--grad_accum_steps=2",
          "--steps_per_loop=1", "--log_every=1000", "--summary_every=1000",
          "--checkpoint_every=1000", "--eval_every=1000", "--eval_steps=2",
          "--noexport_saved_model"]
TIMING_SKIP = 2  # traced steps left out of the median


def built(config):
  """True when train.py defines every flag the row passes."""
  return all(f.lstrip("-").split("=")[0] in FLAGS for f in CONFIGS[config])


def size_flags(size):
  return [f"--{k}={v}" for k, v in SIZES[size].items()]


# ---------------------------------------------------------------- by hand


def parameters(size):
  """{"P": parameters, "sharded": sum of ceil(n/N) over variables,
  "largest_layer": parameters of the largest layer} of the GPT of `size`
  (built here, as train.py builds it: vocabulary of 256 bytes)."""
  import models  # pylint: disable=g-import-not-at-top
  from framework.data import text  # pylint: disable=g-import-not-at-top
  s = SIZES[size]
  model = models.build_model(
      "gpt", (s["sequence_length"],), text.VOCAB_SIZE,
      num_layers=s["num_layers"], num_heads=s["num_heads"],
      model_width=s["model_width"])
  sizes = [v.shape.num_elements() if hasattr(v.shape, "num_elements")
           else math.prod(v.shape) for v in model.trainable_variables]
  # ZeRO-3 gathers the weights of one top-level layer (a unit) at a time.
  units = [sum(math.prod(v.shape) for v in layer.trainable_variables)
           for layer in model.layers]
  return {"P": sum(sizes), "sharded": sum(-(-n // N) for n in sizes),
          "largest_layer": max(units)}


def by_hand(config, p):
  """{weights, gradients, slots} bytes per device, float32, Adam (2 slots).

  Data parallel: 4P, 4P, 8P. ZeRO-1 shards the slots (8P/N), ZeRO-2 the
  gradient too (4P/N), ZeRO-3 the weights as well (4P/N, plus the largest
  layer gathered whole while it computes); a sharded variable is padded to
  a multiple of N; ZeRO-3's weights are its shards at rest (one top-level
  layer's whole weights are gathered while it runs, and the process keeps
  a whole copy on its host for checkpoints and evaluation). The tensor
  split halves every weight (2 shards on the
  model axis) only ideally: the replicated parts show as a difference.
  """
  whole, shard = 4 * p["P"], 4 * p["sharded"]
  if config in MESHES:
    return {"weights": whole // 2, "gradients": whole // 2, "slots": whole}
  # ZeRO-3's at rest: the shards (the unit gathered while it runs and the
  # host's whole copy are reported beside the table).
  weights = shard if config == "ZeRO-3" else whole
  gradients = shard if config in ("ZeRO-2", "ZeRO-3") else whole
  slots = 2 * (whole if config == "data parallel" else shard)
  return {"weights": weights, "gradients": gradients, "slots": slots}


# ---------------------------------------------------------- a worker's run


def _peak_mib():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _nbytes(shape, dtype):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.TensorShape(shape).num_elements() * tf.as_dtype(dtype).size


def _completed(shape, variable_shape):
  """`shape`, its unknown dimensions (static shape inference loses some
  under MultiWorkerMirrored) taken from the variable's shape, which must
  be compatible (a 1-D shard of a 2-D variable is left as it is)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  shape = tf.TensorShape(shape)
  if shape.is_fully_defined():
    return shape
  return shape.merge_with(variable_shape)


def _device_bytes(variables, strategy):
  """{device: bytes} of this process's copies of `variables`."""
  total = {}
  for variable in variables:
    for copy in strategy.experimental_local_results(
        getattr(variable, "value", variable)):
      total[copy.device] = total.get(copy.device, 0) + _nbytes(
          copy.shape, copy.dtype)
  return total


class Recorder:
  """Instruments the trainer `train.py` builds: what it holds, the
  gradients its step accumulates (seen while tracing), its steps' times
  and the process's peak memory."""

  def __init__(self):
    self.trainer = None
    self.built_mib = None
    self.after_steps_mib = None
    self.step_seconds = []
    self.accumulated = []  # per trace and replica: [(shape, dtype)]
    self.applied = []  # (grad shape, dtype, variable device) per variable

  def install(self):
    """Wraps `factory.build_trainer` and the gradient accumulation."""
    from framework.app import factory  # pylint: disable=g-import-not-at-top
    from framework.core import gradients  # pylint: disable=g-import-not-at-top
    build, accumulate = factory.build_trainer, (
        gradients.GradientPipeline.accumulate_gradients)

    def build_trainer(*args, **kwargs):
      trainer, loop = build(*args, **kwargs)
      self.instrument(trainer)
      return trainer, loop

    def accumulate_gradients(trainer, *args, **kwargs):
      grads, metrics = accumulate(trainer, *args, **kwargs)
      self.accumulated.append([(tuple(g.shape), g.dtype.name)
                               for g in grads])
      return grads, metrics

    factory.build_trainer = build_trainer
    gradients.GradientPipeline.accumulate_gradients = accumulate_gradients

  def instrument(self, trainer):
    """Records what `trainer` holds and does from now on."""
    self.trainer = trainer
    self.built_mib = _peak_mib()
    self.built_time = time.time()  # a cluster's workers: their RSS then
    run, apply = trainer.train, trainer.apply_gradients

    def timed_train(iterator, num_steps):
      start = time.perf_counter()
      outputs = run(iterator, num_steps)
      trainer.global_step.numpy()  # the step has finished
      self.step_seconds.append((time.perf_counter() - start) / num_steps)
      self.after_steps_mib = _peak_mib()
      return outputs

    def apply_gradients(grads, variables=None, **kwargs):
      pairs = zip(grads, variables if variables is not None
                  else trainer.model.trainable_variables)
      self.applied = [(_completed(g.shape, v.shape), g.dtype.name,
                       getattr(getattr(v, "value", v), "device", ""))
                      for g, v in pairs if g is not None]
      return apply(grads, variables, **kwargs)

    trainer.train = timed_train
    trainer.apply_gradients = apply_gradients

  def counted(self):
    """{weights, gradients, slots}: {device: bytes} held by this process."""
    trainer = self.trainer
    memory = getattr(trainer, "memory", None)
    if memory is not None:  # a split: its own per-device account
      grads = {}
      for shape, dtype, device in self.applied:
        grads[device] = grads.get(device, 0) + _nbytes(shape, dtype)
      short = {d.split("device:")[-1] if "device:" in d else d: b
               for d, b in grads.items()}
      return {"weights": {d: e["param_bytes"] for d, e in memory.items()},
              "gradients": short,
              "slots": {d: e["optimizer_slot_bytes"]
                        for d, e in memory.items()}}
    strategy = trainer.strategy
    sharding = getattr(trainer, "optimizer_sharding", None)
    slots = (sharding.slot_variables() if sharding is not None else
             # The slots: its step counter and learning rate are scalars.
             [v for v in trainer.optimizer.variables if len(v.shape)])
    parameters_sharded = getattr(trainer, "parameter_sharding", None)
    # ZeRO-3: the replica's weights are its shards (the model's variables
    # are the host's whole copy, outside the replicas).
    weights = _device_bytes(
        parameters_sharded.shards if parameters_sharded is not None
        else trainer.model.trainable_variables, strategy)
    devices = sorted(weights)
    # Replica i's trace saw replica i's gradient (in the devices' order).
    traced = self.accumulated[-len(devices):]
    variables = trainer.model.trainable_variables
    return {"weights": weights,
            "gradients": {d: sum(_nbytes(_completed(s, v.shape), t)
                                 for (s, t), v in zip(g, variables))
                          for d, g in zip(devices, traced)},
            "slots": _device_bytes(slots, strategy)}

  def result(self):
    seconds = self.step_seconds[TIMING_SKIP:] or self.step_seconds
    return {"counted": self.counted(),
            "built_rss_mib": round(self.built_mib, 1),
            "steps_peak_mib": round(self.after_steps_mib - self.built_mib, 1),
            "built_time": self.built_time,
            "steps": len(self.step_seconds),
            "median_step_s": statistics.median(seconds)}


def _rss_mib():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _sample_memory(path):
  """Writes [[time, resident MiB, peak MiB], ...] to `path` every
  `RSS_SAMPLE_S` (a serving worker is stopped by a signal its server's
  join does not return for: the file holds what it saw until then)."""
  import threading  # pylint: disable=g-import-not-at-top
  samples = []

  def run():
    while True:
      samples.append([time.time(), round(_rss_mib(), 1),
                      round(_peak_mib(), 1)])
      with open(path + ".tmp", "w") as f:
        json.dump(samples, f)
      os.replace(path + ".tmp", path)
      time.sleep(RSS_SAMPLE_S)

  threading.Thread(target=run, daemon=True).start()


def record(folder):
  """This process's train.py run, instrumented; writes
  `folder/<task index>.json` (a cluster mesh's serving worker:
  `folder/worker<index>.rss`, its memory samples)."""
  task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
  if (task.get("type") == "worker"
      and "--model_parallel_devices=cluster" in sys.argv):
    _sample_memory(os.path.join(folder, f"worker{task.get('index', 0)}.rss"))
  recorder = Recorder()
  recorder.install()
  train.warn_unread_flags()
  train.check_tf_config_early()
  train.run_main()
  if recorder.trainer is None:  # a worker that served until stopped
    return
  with open(os.path.join(folder, f"{task.get('index', 0)}.json"), "w") as f:
    json.dump(recorder.result(), f)


# ------------------------------------------------------------ the driver


def _flags_of(size, config, recompute, steps, model_dir):
  strategy = ([] if config in MESHES
              else ["--strategy=multi_worker_mirrored"])
  return (COMMON + strategy + size_flags(size) + CONFIGS[config] + [
      f"--recompute={recompute}", f"--train_steps={steps}",
      f"--model_dir={model_dir}"])


def _worker_activations(samples, built_time):
  """A serving worker's peak resident MiB minus its resident MiB when the
  chief's trainer was built (the first sample from then on)."""
  base = next((rss for t, rss, _ in samples if t >= built_time),
              samples[-1][1])
  return samples[-1][2] - base


def launch(size, config, recompute, steps, workdir, net=None):
  """One run of `steps` steps; (the training processes' records, the
  serving workers' memory samples, {(role, index): tx bytes} or None)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  from framework.distribute import launcher  # pylint: disable=g-import-not-at-top
  folder = tempfile.mkdtemp(dir=workdir)
  command = [sys.executable, os.path.abspath(__file__),
             f"--record={folder}"] + _flags_of(
                 size, config, recompute, steps, os.path.join(folder, "run"))
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  log_path = os.path.join(workdir, "log.txt")
  with open(log_path, "a") as log:
    if config == MESH:  # one process: its devices are logical CPUs
      status = subprocess.run(command, stdout=log, stderr=log,
                              env=env).returncode
      sent = None
    else:
      # The cluster mesh: a chief (the loop) and N serving workers.
      chief = config == MESH_CLUSTER
      # A fresh port each run: a stopped server's may still be held.
      launch.port = getattr(launch, "port", 2222) + 1
      cluster = (launcher.cluster_on_hosts(net.addresses, N, 0, chief=chief,
                                           port=launch.port)
                 if net else launcher.local_cluster(N, 0, chief=chief))
      order = {task: i for i, task in enumerate(launcher.tasks_of(cluster))}
      before = net.counters() if net else None
      job = launcher.Launcher(
          command, cluster, grace_period=2, output=log, env=env,
          serving_workers=chief,
          task_prefix=(lambda role, index: net.prefix(order[(role, index)]))
          if net else None)
      status = job.run()
      sent = None
      if net:
        after = net.counters()
        # {task: (rx, tx)} bytes over the run.
        sent = {task: (after[h][0] - before[h][0], after[h][1] - before[h][1])
                for task, h in order.items()}
  if status:
    with open(log_path) as log:
      raise RuntimeError(f"{size} {config} --recompute={recompute}: exit "
                         f"{status}: {log.read()[-3000:]}")
  records, workers = [], []
  for name in sorted(os.listdir(folder)):
    if name.endswith((".json", ".rss")):
      with open(os.path.join(folder, name)) as f:
        (workers if name.endswith(".rss") else records).append(json.load(f))
  return records, workers, sent


def _per_step(long_sent, short_sent, tasks, rx=False):
  """Tx (`rx`: received) bytes per step and host over `tasks` (the long
  run's minus the short run's, over the steps' difference)."""
  return round(sum(long_sent[t][not rx] - short_sent[t][not rx]
                   for t in tasks) / (FLAGS.long - FLAGS.short) / len(tasks))


def _max_over_devices(records, key):
  return max(b for r in records for b in r["counted"][key].values())


def row(size, config, recompute, p, workdir, net):
  """One measured row (a dict)."""
  result = {"size": size, "config": config, "recompute": recompute,
            "flags": CONFIGS[config], "by_hand": by_hand(config, p)}
  if not built(config):
    result["status"] = "not built"
    return result
  records, workers, long_sent = launch(size, config, recompute, FLAGS.long,
                                       workdir, net)
  if net and config != MESH:
    _, _, short_sent = launch(size, config, recompute, FLAGS.short, workdir,
                              net)
    result["wire_bytes_per_step_per_host"] = _per_step(
        long_sent, short_sent, [t for t in long_sent if t[0] == "worker"])
    if config == MESH_CLUSTER:  # the loop's inputs and remote calls
      result["chief_wire_bytes_per_step"] = _per_step(
          long_sent, short_sent, [("chief", 0)])
      # What the workers sent the chief (the rest went to the other one).
      result["chief_received_bytes_per_step"] = _per_step(
          long_sent, short_sent, [("chief", 0)], rx=True)
  s = SIZES[size]
  step = statistics.median(r["median_step_s"] for r in records)
  peak = max(r["steps_peak_mib"] for r in records)
  if workers:  # the cluster mesh: its devices are the workers'
    result["chief_steps_peak_mib"] = peak
    peak = round(max(_worker_activations(w, records[0]["built_time"])
                     for w in workers), 1)
  result.update(
      status="measured",
      counted={k: _max_over_devices(records, k)
               for k in ("weights", "gradients", "slots")},
      devices={k: sorted({d for r in records for d in r["counted"][k]})
               for k in ("weights",)},
      peak_activations_mib=peak,
      median_step_s=round(step, 4),
      tokens_per_s=round(s["global_batch_size"] * s["sequence_length"]
                         / step, 1),
      processes=len(records) + len(workers))
  return result


def _mb(value):
  return "-" if value is None else f"{value / 1e6:.3f}"


def markdown(rows):
  """The table: bytes per device (by hand / counted), MB; the rest."""
  lines = ["| size | sharding | --recompute | weights MB (by hand / counted) "
           "| gradients MB | optimizer slots MB | peak activations MiB | "
           "wire MB per step per host | tokens/s |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    hand = r["by_hand"]
    if r["status"] != "measured":
      cells = [f"{_mb(hand[k])} / not built"
               for k in ("weights", "gradients", "slots")]
      rest = ["not built"] * 3
    else:
      cells = [f"{_mb(hand[k])} / {_mb(r['counted'][k])}"
               for k in ("weights", "gradients", "slots")]
      wire = r.get("wire_bytes_per_step_per_host")
      rest = [f"{r['peak_activations_mib']:.0f}"
              if "peak_activations_mib" in r else "-",
              ("one process" if r["config"] == MESH else
               "not measured" if wire is None else _mb(wire)),
              f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "-"]
    lines.append(f"| {r['size']} | {r['config']} | {r['recompute']} | "
                 + " | ".join(cells + rest) + " |")
  return "\n".join(lines)


def trainer_options(config):
  """`framework.Trainer` keyword arguments of a row's train.py flags
  (`--shard_optimizer_state` -> shard_optimizer_state=True)."""
  options = {}
  for flag in CONFIGS[config]:
    name, _, value = flag.lstrip("-").partition("=")
    options[name] = value or True
  return options


def check():
  """The rows of the tiny GPT's counts: each sharding's trainer built and
  stepped once on 2 mirrored logical CPU devices in this process (the
  trainer train.py builds, without its loop: seconds, not a run)."""
  from framework.distribute import strategies  # pylint: disable=g-import-not-at-top
  strategies.configure_cpu_devices(N)
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from framework.core import optimizers  # pylint: disable=g-import-not-at-top
  from framework.core.config import OptimizerConfig  # pylint: disable=g-import-not-at-top
  from framework.data import text  # pylint: disable=g-import-not-at-top
  from framework.tasks import language_model  # pylint: disable=g-import-not-at-top
  s = SIZES["tiny"]
  p = parameters("tiny")
  strategy = strategies.make_strategy("mirrored")
  tokens = np.random.RandomState(0).randint(
      0, text.VOCAB_SIZE, (s["global_batch_size"], s["sequence_length"] + 1))
  data = tf.data.Dataset.from_tensors(
      (tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")))
  rows = []
  recorder = Recorder()
  recorder.install()
  for config in CONFIGS:
    if config in MESHES:
      continue
    result = {"size": "tiny", "config": config, "recompute": "none",
              "P": p["P"], "by_hand": by_hand(config, p),
              "status": "not built"}
    rows.append(result)
    if not built(config):
      continue
    keras.utils.set_random_seed(0)
    with strategy.scope():
      model = models.build_model(
          "gpt", (s["sequence_length"],), text.VOCAB_SIZE,
          num_layers=s["num_layers"], num_heads=s["num_heads"],
          model_width=s["model_width"])
      optimizer = optimizers.make_optimizer(OptimizerConfig(name="adam"))
    options = trainer_options(config)
    trainer_cls = language_model.LanguageModelTrainer
    if options.pop("shard_parameters", None):  # the row sets it or not
      from framework.model_parallel import parameter_sharding  # pylint: disable=g-import-not-at-top
      trainer_cls = parameter_sharding.sharded_trainer(trainer_cls)
    trainer = trainer_cls(
        model, optimizer, strategy, global_batch_size=s["global_batch_size"],
        **options)
    recorder.instrument(trainer)
    trainer.train(iter(strategy.experimental_distribute_dataset(
        data.repeat())), 1)
    counted = recorder.counted()
    result.update(status="measured", per_device=counted,
                  counted={k: max(counted[k].values()) for k in counted})
  return rows


def main(argv):
  del argv
  json_path = FLAGS.json  # `check` parses the flags again, for train.py
  if FLAGS.record:
    record(FLAGS.record)
    return
  if FLAGS.check:
    rows = check()
    print(markdown(rows))
    wrong = [f"{r['config']} {k}: by hand {r['by_hand'][k]}, counted "
             f"{r['per_device'][k]}" for r in rows if r["status"] == "measured"
             for k in ("weights", "gradients", "slots")
             if set(r["per_device"][k].values()) != {r["by_hand"][k]}
             or len(r["per_device"][k]) != N]
    if json_path:
      with open(json_path, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    for line in wrong:
      print(f"mismatch: {line}")
    if wrong:
      sys.exit(1)
    print("counted = by hand for every row")
    return
  from framework.distribute import netns  # pylint: disable=g-import-not-at-top
  reason = netns.missing()
  if reason:
    print(f"bytes on the wire: not measured ({reason})")
  configs = FLAGS.configs or list(CONFIGS)
  load_before = host.load_average()
  print(load_before, flush=True)
  rows = []
  started = time.time()
  with tempfile.TemporaryDirectory() as workdir:
    # The cluster mesh's chief needs a host of its own.
    hosts = N + (MESH_CLUSTER in configs)
    net = None if reason else netns.HostNetwork(hosts, name="dlmt")
    try:
      if net:
        net.__enter__()
      for size in FLAGS.sizes:
        p = parameters(size)
        print(f"{size}: {SIZES[size]}, {p['P']} parameters", flush=True)
        for config in configs:
          for recompute in FLAGS.recompute_values:
            rows.append(row(size, config, recompute, p, workdir, net))
            rows[-1]["P"] = p["P"]
            print(json.dumps(rows[-1]), flush=True)
    finally:
      if net:
        net.__exit__(None, None, None)
  load_after = host.load_average()
  print(f"{load_before} before, {load_after} after, "
        f"{time.time() - started:.0f} s")
  print(markdown(rows))
  if FLAGS.json:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    with open(FLAGS.json, "w") as f:
      json.dump({"sizes": {s: SIZES[s] for s in FLAGS.sizes},
                 "common_flags": COMMON, "short": FLAGS.short,
                 "long": FLAGS.long,
                 "host": {"cpu": host.cpu_model(), "cores": os.cpu_count(),
                          "tensorflow": tf.__version__,
                          "load_before": load_before,
                          "load_after": load_after,
                          "seconds": round(time.time() - started)},
                 "rows": rows}, f, indent=1)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
