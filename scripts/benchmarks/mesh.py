"""Benchmark: the GPT on every mesh, examples/s and bytes per device.

    python scripts/benchmarks/mesh.py                # 2 sizes x 10 meshes
    python scripts/benchmarks/mesh.py --quick        # a smoke run, ~1-2 min

For each GPT size (--sizes: width:layers:heads) and each configuration
(--meshes), all in one run, each in a child process of its own (logical
devices are fixed when TensorFlow starts, and a peak RSS is a whole
process's), the same Adam step on the same global batch of random byte
tokens:

  * examples/s and tokens/s, timed after --warmup_loops (the trace) over
    --loops calls of --steps_per_loop steps, against the unsplit model
    measured in the same run;
  * parameter and optimizer-slot bytes per device, each variable counted on
    its own device (`.device` of every copy: the split's shards, the data
    axis's copies, a MirroredStrategy's per-replica values), beside the
    computed figure: unsplit / (model x pipeline axes), Adam's slots 2 x
    that, slots / data axis with ZeRO-1 (--shard_optimizer_state);
  * the peak RSS (`ru_maxrss`) of the measuring process, or of the largest
    process of a 2-process launch: on CPU one process holds all its logical
    devices, so it is not a per-device figure;
  * the computed cost of the split per step: the model-axis all-reduces
    (per micro-batch, forward: the embedding's and 2 per block, each of
    b x T x width floats, b the copy's micro-batch; backward: the same
    again, the all-reduce's gradient being an all-reduce; plus the
    vocab-parallel loss's all-gather of 4 floats per token and shard, both
    ways), the data-axis gradient all-reduce (each device's parameter
    bytes, over the data axis; ZeRO-1: that all-reduce, then an all-gather
    of the updated weights) and the pipeline's activation sends (forward and
    backward, per stage boundary).

Local meshes run on 4 (or fewer) logical CPU devices of one process,
built as scripts/train.py builds them (`ModelParallelConfig(mesh=...)`),
a pipeline axis included: `--mesh` runs the GPT's pipeline as its own
split with one shard per stage (`TensorParallelTrainer(num_shards=1,
tensor_stages=S)`, `framework/model_parallel/tensor_parallel.py`);
`mwms:2` and `cluster:data:2,model:2` run scripts/train.py on 2 worker
processes (scripts/launch.py --workers=2; examples/s from their logs, bytes
from the split's logged per-device memory; MWMS logs none, so only its
computed figure is shown). Prints the host and the load average at the
start and the end: a shared machine slows every figure.
"""

import json
import os
import re
import resource
import shutil
import statistics
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

from scripts import cli  # pylint: disable=g-import-not-at-top
from scripts.benchmarks import host  # pylint: disable=g-import-not-at-top

cli.quiet_startup()

FLAGS = flags.FLAGS
MESHES = ("unsplit", "model:2", "model:4", "data:2,model:2",
          "data:2,model:2+zero1", "data:2,pipeline:2", "model:2,pipeline:2",
          "mirrored:4",
          "mirrored:4+zero1", "mwms:2", "cluster:data:2,model:2")
QUICK_MESHES = ("unsplit", "model:2", "data:2,model:2", "mirrored:4+zero1",
                "cluster:data:2,model:2")
flags.DEFINE_list("sizes", ["128:4:4", "256:4:4"], "GPT sizes, each "
                  "width:layers:heads.")
flags.DEFINE_spaceseplist(
    "meshes", list(MESHES), "Configurations, space-separated: unsplit (1 "
    "device), a --mesh value (logical CPU devices of one process), "
    "mirrored:N (data parallel; +zero1: --shard_optimizer_state), mwms:N "
    "(N MultiWorkerMirrored processes; +zero1 too), cluster:MESH "
    "(--model_parallel_devices=cluster on one worker process per copy); "
    "a mesh with a data axis takes +zero1 too.")
flags.DEFINE_integer("sequence_length", 64, "Tokens per example T.")
flags.DEFINE_integer("global_batch_size", 16, "Examples per step.")
flags.DEFINE_integer("num_microbatches", 4, "Micro-batches of a mesh with "
                     "a pipeline axis (GPipe); 1 for the others.")
flags.DEFINE_integer("steps_per_loop", 3, "Steps per timed call.")
flags.DEFINE_integer("warmup_loops", 1, "Untimed calls first (the trace).")
flags.DEFINE_integer("loops", 3, "Timed calls (the median is reported).")
flags.DEFINE_bool("quick", False, "A smoke run: one tiny GPT (32:2:4), "
                  f"{', '.join(QUICK_MESHES)}, 1 timed call of 2 steps.")
flags.DEFINE_integer("child_timeout", 600, "Seconds per configuration.")
flags.DEFINE_string("output_json", None, "Write all figures here.")
flags.DEFINE_string("result_file", None, "Internal: measure --meshes[0] at "
                    "--sizes[0] in this process and write it here.")
VOCAB = 256
MIB = 1 << 20
_RATE = re.compile(r"train step \d+/\d+: .*?examples/s=([0-9.]+)")
_MEMORY = re.compile(r"model-parallel memory per device: (.*)")
_DEVICE = re.compile(r"(\S+): params (\d+) B, optimizer slots (\d+) B")


def _size(text):
  try:
    width, layers, heads = (int(v) for v in text.split(":"))
  except ValueError:
    sys.exit(f"mesh.py: error: --sizes={text} must be width:layers:heads, "
             "e.g. 128:4:4")
  return dict(width=width, layers=layers, heads=heads)


def _axes(mesh):
  """(data, model, pipeline, zero1) of a configuration name."""
  mesh, _, zero = mesh.partition("+")
  if mesh == "unsplit":
    return 1, 1, 1, False
  if mesh.startswith(("mirrored:", "mwms:")):
    return int(mesh.split(":", 1)[1]), 1, 1, zero == "zero1"
  from framework.model_parallel.config import parse_mesh  # pylint: disable=g-import-not-at-top
  sizes = parse_mesh(mesh.removeprefix("cluster:"))
  return (sizes.get("data", 1), sizes.get("model", 1),
          sizes.get("pipeline", 1), zero == "zero1")


def _check_meshes():
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  for mesh in FLAGS.meshes:
    try:
      data, model, pipeline, _ = _axes(mesh)
    except (ConfigError, ValueError) as error:
      sys.exit(f"mesh.py: error: --meshes={mesh}: {error} (one of "
               f"{', '.join(MESHES)} or another --mesh value)")
    launched = mesh.startswith(("cluster:", "mwms:"))
    if data * model * pipeline > 4 and not launched:
      sys.exit(f"mesh.py: error: --meshes={mesh} needs "
               f"{data * model * pipeline} devices; at most 4")


def _microbatches(mesh):
  return FLAGS.num_microbatches if _axes(mesh)[2] > 1 else 1


def _by_device(variables, strategy):
  """{device: bytes} of a strategy's variables' per-replica copies, each on
  its own device."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework.model_parallel.devices import short_device  # pylint: disable=g-import-not-at-top
  total = {}
  for variable in variables:
    for copy in strategy.experimental_local_results(
        getattr(variable, "value", variable)):
      device = short_device(copy.device)
      total[device] = total.get(device, 0) + (
          int(np.prod(copy.shape)) * tf.as_dtype(copy.dtype).size)
  return total


def _slots(optimizer):
  """Per-parameter slots: not the step counter or a scalar learning rate."""
  return [v for v in optimizer.variables
          if v is not optimizer.iterations and len(v.shape)]


def _measure():
  """One configuration in this process: its figures as a dict."""
  import framework  # pylint: disable=g-import-not-at-top
  mesh, size = FLAGS.meshes[0], _size(FLAGS.sizes[0])
  data, model_axis, pipeline, zero = _axes(mesh)
  framework.configure_cpu_devices(data * model_axis * pipeline)
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from framework.model_parallel import ModelParallelConfig, memory_by_device  # pylint: disable=g-import-not-at-top
  from framework.model_parallel.devices import short_device  # pylint: disable=g-import-not-at-top
  mirrored = mesh.startswith("mirrored:")
  strategy = framework.make_strategy("mirrored" if mirrored else "default")
  keras.utils.set_random_seed(0)
  with strategy.scope():
    model = models.build_model(
        "gpt", (FLAGS.sequence_length,), VOCAB, num_layers=size["layers"],
        num_heads=size["heads"], model_width=size["width"])
    optimizer = keras.optimizers.Adam(1e-3)
  parameters = int(sum(v.shape.num_elements()
                       for v in model.trainable_variables))
  kwargs = dict(global_batch_size=FLAGS.global_batch_size,
                shard_optimizer_state=zero)
  if mesh in ("unsplit",) or mirrored:
    trainer = framework.Trainer(model, optimizer, strategy, **kwargs)
  else:
    config, strategy = ModelParallelConfig(
        mesh=mesh.partition("+")[0],
        num_microbatches=_microbatches(mesh)).with_strategy(
            strategy, "default")
    trainer = config.trainer_factory()(model, optimizer, strategy, **kwargs)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCAB, (FLAGS.global_batch_size,
                                   FLAGS.sequence_length + 1))
  dataset = tf.data.Dataset.from_tensors(
      (tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32))
  ).repeat()
  iterator = iter(strategy.experimental_distribute_dataset(dataset))
  for _ in range(FLAGS.warmup_loops):
    float(trainer.train(iterator, FLAGS.steps_per_loop)["loss"])
  seconds = []
  for _ in range(FLAGS.loops):
    start = time.perf_counter()
    float(trainer.train(iterator, FLAGS.steps_per_loop)["loss"])
    seconds.append((time.perf_counter() - start) / FLAGS.steps_per_loop)
  if mirrored:
    sharding = trainer.optimizer_sharding
    param_bytes = _by_device(model.trainable_variables, strategy)
    slot_bytes = _by_device(sharding.slot_variables() if sharding
                            else _slots(optimizer), strategy)
  else:
    placed = [(trainer.model, trainer.optimizer)] + [
        (clone, copy_optimizer)
        for _, clone, copy_optimizer in getattr(trainer, "copies", [])]
    param_bytes, slot_bytes = {}, {}
    for placed_model, placed_optimizer in placed:
      for device, entry in memory_by_device(placed_model,
                                            placed_optimizer).items():
        device = short_device(device)
        param_bytes[device] = (param_bytes.get(device, 0) +
                               entry["param_bytes"])
        slot_bytes[device] = (slot_bytes.get(device, 0) +
                              entry["optimizer_slot_bytes"])
  step = statistics.median(seconds)
  return dict(
      mesh=mesh, size=FLAGS.sizes[0], parameters=parameters,
      examples_per_s=FLAGS.global_batch_size / step,
      tokens_per_s=FLAGS.global_batch_size * FLAGS.sequence_length / step,
      param_bytes=param_bytes, slot_bytes=slot_bytes,
      peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
      * 1024)


def _child(mesh, size):
  with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
    path = f.name
  try:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), f"--result_file={path}",
         f"--meshes={mesh}", f"--sizes={size}", *_shared()],
        capture_output=True, text=True, timeout=FLAGS.child_timeout)
    if proc.returncode != 0:
      sys.exit(f"mesh.py: error: {mesh} at size {size} failed:\n"
               f"{proc.stderr[-3000:]}")
    with open(path) as f:
      return json.load(f)
  finally:
    os.remove(path)


def _shared():
  return [f"--{name}={FLAGS[name].value}" for name in (
      "sequence_length", "global_batch_size", "num_microbatches",
      "steps_per_loop", "warmup_loops", "loops")]


def _launched(mesh, size):
  """scripts/train.py on one worker process per data-axis copy: examples/s
  from its log, the split's logged bytes, the largest process's peak RSS."""
  spec = _size(size)
  steps = (FLAGS.warmup_loops + FLAGS.loops) * FLAGS.steps_per_loop
  model_dir = tempfile.mkdtemp(prefix="distloop_mesh_bench_")
  data, model_axis, pipeline, zero = _axes(mesh)
  split = (["--strategy=multi_worker_mirrored",
            f"--shard_optimizer_state={str(zero).lower()}"]
           if mesh.startswith("mwms:")
           else [f"--mesh={mesh.partition('+')[0].removeprefix('cluster:')}",
                 f"--shard_optimizer_state={str(zero).lower()}",
                 "--model_parallel_devices=cluster",
                 f"--cpu_devices={model_axis * pipeline}",
                 f"--num_microbatches={_microbatches(mesh)}"])
  command = [
      sys.executable, os.path.join(ROOT, "scripts", "launch.py"),
      f"--workers={data}", "--grace_period=5", "--", sys.executable,
      os.path.join(ROOT, "scripts", "train.py"), "--model=gpt",
      "--dataset=text", f"--sequence_length={FLAGS.sequence_length}",
      f"--model_width={spec['width']}", f"--num_layers={spec['layers']}",
      f"--num_heads={spec['heads']}", "--optimizer=adam",
      "--learning_rate=0.001",
      f"--global_batch_size={FLAGS.global_batch_size}",
      f"--train_steps={steps}", f"--steps_per_loop={FLAGS.steps_per_loop}",
      f"--log_every={FLAGS.steps_per_loop}", f"--summary_every={steps}",
      f"--checkpoint_every={steps}", "--eval_steps=1",
      "--export_saved_model=false", f"--model_dir={model_dir}", *split]
  try:
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(FLAGS.child_timeout, proc.kill)
    timer.start()
    output = proc.stdout.read()
    # wait4: the launch's own rusage, whose ru_maxrss covers the tasks it
    # waited for: the largest process of the run.
    _, status, usage = os.wait4(proc.pid, 0)
    timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
  finally:
    shutil.rmtree(model_dir, ignore_errors=True)
  rates = [float(r) for r in _RATE.findall(output)]
  skip = FLAGS.warmup_loops
  if proc.returncode or len(rates) <= skip:
    sys.exit(f"mesh.py: error: {mesh} at size {size} (scripts/launch.py "
             f"--workers={data}) failed (exit {proc.returncode}):\n"
             f"{output[-3000:]}")
  # Each task logs its own loops; the ones after the warm-up are timed.
  timed = [r for i, r in enumerate(rates) if i % (skip + FLAGS.loops) >= skip]
  param_bytes, slot_bytes = {}, {}
  for line in _MEMORY.findall(output):
    for device, params, slots in _DEVICE.findall(line):
      param_bytes[device], slot_bytes[device] = int(params), int(slots)
  rate = statistics.median(timed or rates[skip:])
  return dict(mesh=mesh, size=size, parameters=None, examples_per_s=rate,
              tokens_per_s=rate * FLAGS.sequence_length,
              param_bytes=param_bytes, slot_bytes=slot_bytes,
              peak_rss_bytes=usage.ru_maxrss * 1024)


def computed(result, parameters):
  """The computed bytes per device and communication per step of a case."""
  size = _size(result["size"])
  data, model_axis, pipeline, zero = _axes(result["mesh"])
  param_bytes = parameters * 4 / (model_axis * pipeline)
  rows = FLAGS.global_batch_size // data  # one copy's batch
  micro = _microbatches(result["mesh"])
  stream = rows * FLAGS.sequence_length * size["width"] * 4
  cost = dict(param_bytes=param_bytes,
              slot_bytes=2 * param_bytes / (data if zero else 1),
              model_all_reduces=0, model_bytes=0, data_bytes=0,
              data_collectives=0, send_bytes=0)
  if model_axis > 1:
    # Per micro-batch: embedding + 2 per block forward, as many backward;
    # the loss's all-gather ([D, b, T, 4] floats) both ways.
    per_pass = 1 + 2 * size["layers"]
    cost["model_all_reduces"] = micro * 2 * (per_pass + 1)
    cost["model_bytes"] = 2 * per_pass * stream + 2 * (
        model_axis * rows * FLAGS.sequence_length * 4 * 4)
  if data > 1:
    cost["data_collectives"] = 2 if zero else 1
    cost["data_bytes"] = param_bytes
  if pipeline > 1:
    # Each boundary: the residual stream forward, its gradient back (one
    # copy per model-axis device).
    cost["send_bytes"] = (pipeline - 1) * 2 * stream * model_axis
  return cost


def _mib(value):
  return f"{value / MIB:.2f}"


def _spread(per_device):
  """`min-max` MiB over the devices (one figure when they agree)."""
  if not per_device:
    return "n/a"
  low, high = min(per_device.values()), max(per_device.values())
  return _mib(high) if _mib(low) == _mib(high) else (
      f"{_mib(low)}-{_mib(high)}")


def _row(result, cost, base):
  measured = {d: result["param_bytes"][d] + result["slot_bytes"].get(d, 0)
              for d in result["param_bytes"]}
  unsplit = cost["unsplit_bytes"]
  ratio = (f"{max(measured.values()) / unsplit:.3f}" if measured else "n/a")
  model = (f"{cost['model_all_reduces']} / {_mib(cost['model_bytes'])}"
           if cost["model_all_reduces"] else "-")
  data = (f"{cost['data_collectives']} / {_mib(cost['data_bytes'])}"
          if cost["data_collectives"] else "-")
  sends = _mib(cost["send_bytes"]) if cost["send_bytes"] else "-"
  return (f"| {result['size']} | {result['mesh']} | "
          f"{result['examples_per_s']:.1f} | {result['tokens_per_s']:.0f} | "
          f"{result['examples_per_s'] / base:.2f} | "
          f"{_spread(result['param_bytes'])} | "
          f"{_spread(result['slot_bytes'])} | "
          f"{_mib(cost['param_bytes'] + cost['slot_bytes'])} | {ratio} | "
          f"{cost['goal_ratio']:.3f} | "
          f"{result['peak_rss_bytes'] / MIB:.0f} | {model} | {data} | "
          f"{sends} |")


def _apply_quick():
  if not FLAGS.quick:
    return
  for name, value in (("sizes", ["32:2:4"]), ("meshes", list(QUICK_MESHES)),
                      ("steps_per_loop", 2), ("warmup_loops", 1),
                      ("loops", 1)):
    if not FLAGS[name].present:
      FLAGS[name].value = value


def bench():
  if FLAGS.result_file:
    with open(FLAGS.result_file, "w") as f:
      json.dump(_measure(), f)
    return
  _apply_quick()
  for text in FLAGS.sizes:
    _size(text)
  _check_meshes()
  print(f"host: {host.cpu_model()}, {os.cpu_count()} cores; "
        f"{host.load_average()} at the start")
  print(f"GPT, byte vocabulary {VOCAB}, T={FLAGS.sequence_length}, global "
        f"batch {FLAGS.global_batch_size}, Adam; median of {FLAGS.loops} "
        f"calls of {FLAGS.steps_per_loop} steps after {FLAGS.warmup_loops}; "
        f"pipeline meshes M={FLAGS.num_microbatches}. MiB per device "
        "(min-max over the devices); costs per step: count / MiB\n")
  print("| size w:L:h | mesh | examples/s | tokens/s | vs unsplit | params "
        "MiB | slots MiB | computed params+slots MiB | measured max / "
        "unsplit | computed / unsplit | peak RSS MiB | model-axis "
        "all-reduces | data-axis gradient | pipeline sends MiB |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  results = []
  for size in FLAGS.sizes:
    base = parameters = None
    for mesh in FLAGS.meshes:
      started = time.perf_counter()
      result = (_launched(mesh, size)
                if mesh.startswith(("mwms:", "cluster:"))
                else _child(mesh, size))
      result["seconds"] = time.perf_counter() - started
      parameters = parameters or result["parameters"]
      base = base or result["examples_per_s"]
      if parameters is None:
        sys.exit("mesh.py: error: list a local configuration (e.g. unsplit) "
                 "before mwms:/cluster: in --meshes (it counts the "
                 "parameters)")
      cost = computed(result, parameters)
      cost["unsplit_bytes"] = parameters * 4 * 3
      cost["goal_ratio"] = (cost["param_bytes"] + cost["slot_bytes"]) / (
          cost["unsplit_bytes"])
      result["parameters"], result["computed"] = parameters, cost
      print(_row(result, cost, base), flush=True)
      results.append(result)
  print(f"\n{host.load_average()} at the end; vs unsplit: examples/s over "
        f"the first configuration's ({FLAGS.meshes[0]}) of the same size")
  if FLAGS.output_json:
    with open(FLAGS.output_json, "w") as f:
      json.dump(dict(flags={name: FLAGS[name].value for name in (
          "sizes", "meshes", "sequence_length", "global_batch_size",
          "num_microbatches", "steps_per_loop", "warmup_loops", "loops")},
                     host=host.cpu_model(), rows=results), f, indent=1)


main = cli.main_running(bench)

if __name__ == "__main__":
  app.run(main)
