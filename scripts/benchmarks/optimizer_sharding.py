"""Benchmark: parameter and optimizer-slot bytes per device, ZeRO-1 or not.

    python scripts/benchmarks/optimizer_sharding.py      # mlp, gpt x2; N=2,4

For each model (--models: the MLP, a tiny GPT, a bigger GPT) and each
replica count N (--replicas, logical CPU devices of a MirroredStrategy),
trains --steps Adam steps with and without --shard_optimizer_state, each in
a child process of its own (the logical devices are fixed when TensorFlow
starts, and a peak RSS is a whole process's), and prints per device:

  * parameter bytes and optimizer-slot bytes, summed over the copies of the
    variables placed on that device (each copy's own `.device`), with the
    computed figure beside them (Adam: 2 x parameters; sharded: 2 x
    ceil(n / N) per variable) and the shard buffers the sharded update
    keeps (1 x ceil(n / N) per variable);
  * the process's peak resident memory (`resource.getrusage`), which on
    CPU holds every device's variables, activations and TensorFlow itself.

Also the weights after the steps, sharded against unsharded (max |diff|).
CPU devices report no allocator statistics
(`tf.config.experimental.get_memory_info` raises for them), so bytes come
from the variables; on a GPU the same script adds the allocator's peak.
Prints the host's load average: on a shared machine the peak RSS is this
process's own, the load only slows it.
"""

import json
import math
import os
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from scripts import cli  # pylint: disable=g-import-not-at-top
from scripts.benchmarks import host  # pylint: disable=g-import-not-at-top

cli.quiet_startup()

FLAGS = flags.FLAGS
MODELS = {
    "mlp": dict(model="mlp", input_shape=(32, 32, 3), classes=10,
                options=dict(hidden_units=(512, 512), dropout=False)),
    "gpt_tiny": dict(model="gpt", input_shape=(64,), classes=256,
                     options=dict(num_layers=2, num_heads=4, model_width=64)),
    "gpt_small": dict(model="gpt", input_shape=(128,), classes=256,
                      options=dict(num_layers=4, num_heads=8,
                                   model_width=256)),
}
flags.DEFINE_list("models", list(MODELS), f"Of {', '.join(MODELS)}.")
flags.DEFINE_list("replicas", ["2", "4"], "Logical CPU devices (replicas).")
flags.DEFINE_integer("steps", 3, "Adam steps per measurement.")
flags.DEFINE_integer("global_batch_size", 16, "Examples per step.")
flags.DEFINE_string("output_json", None, "Write all figures here.")
flags.DEFINE_string("result_file", None, "Internal: measure one case "
                    "(--models[0], --replicas[0], --shard) here.")
flags.DEFINE_bool("shard", False, "Internal: with --result_file.")
MIB = 1 << 20


def _bytes_per_device(variables, strategy):
  """{device: bytes} of the variables' copies, by each copy's device."""
  total = {}
  for variable in variables:
    for copy in strategy.experimental_local_results(
        getattr(variable, "value", variable)):
      total[copy.device] = total.get(copy.device, 0) + (
          copy.shape.num_elements() * copy.dtype.size)
  return total


def _measure():
  """One case in this process: its figures as a dict."""
  import framework  # pylint: disable=g-import-not-at-top
  replicas = int(FLAGS.replicas[0])
  framework.configure_cpu_devices(replicas)
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  spec = MODELS[FLAGS.models[0]]
  strategy = framework.make_strategy("mirrored")
  keras.utils.set_random_seed(0)
  with strategy.scope():
    model = models.build_model(spec["model"], spec["input_shape"],
                               spec["classes"], **spec["options"])
    optimizer = keras.optimizers.Adam(1e-3)
  trainer = framework.Trainer(model, optimizer, strategy,
                              global_batch_size=FLAGS.global_batch_size,
                              shard_optimizer_state=FLAGS.shard)
  rng = np.random.default_rng(0)
  batch = FLAGS.global_batch_size
  if spec["model"] == "gpt":
    tokens = rng.integers(0, spec["classes"], (batch,) + spec["input_shape"])
    features, labels = tokens.astype(np.int32), np.roll(tokens, -1, 1)
  else:
    features = rng.normal(size=(batch,) + spec["input_shape"]).astype(
        np.float32)
    labels = rng.integers(0, spec["classes"], batch)
  dataset = tf.data.Dataset.from_tensors(
      (features, labels.astype(np.int32))).repeat()
  iterator = iter(strategy.experimental_distribute_dataset(dataset))
  trainer.train(iterator, FLAGS.steps)
  sharding = trainer.optimizer_sharding
  slots = (sharding.slot_variables() if sharding else
           [v for v in optimizer.variables
            if v is not optimizer.iterations and v.shape.rank])
  params = model.trainable_variables
  computed = [math.ceil(v.shape.num_elements() / (replicas if sharding
                                                  else 1)) * 4 * 2
              for v in params]
  result = dict(
      model=FLAGS.models[0], replicas=replicas, sharded=FLAGS.shard,
      parameters=int(sum(v.shape.num_elements() for v in params)),
      param_bytes=_bytes_per_device(params, strategy),
      slot_bytes=_bytes_per_device(slots, strategy),
      shard_buffer_bytes=(_bytes_per_device(sharding.shards, strategy)
                          if sharding else {}),
      computed_slot_bytes=int(sum(computed)),
      peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
  np.savez(FLAGS.result_file + ".npz", *[v.numpy() for v in params])
  gpus = tf.config.list_logical_devices("GPU")
  if gpus:
    result["allocator_peak_bytes"] = {
        d.name: tf.config.experimental.get_memory_info(d.name)["peak"]
        for d in gpus}
  return result


def _child(model, replicas, shard):
  import numpy as np  # pylint: disable=g-import-not-at-top
  with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
    path = f.name
  try:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), f"--result_file={path}",
         f"--models={model}", f"--replicas={replicas}",
         f"--shard={str(shard).lower()}", f"--steps={FLAGS.steps}",
         f"--global_batch_size={FLAGS.global_batch_size}"],
        capture_output=True, text=True)
    if proc.returncode != 0:
      sys.exit(f"optimizer_sharding.py: error: {model} on {replicas} "
               f"replicas (shard={shard}) failed:\n{proc.stderr[-3000:]}")
    with open(path) as f:
      result = json.load(f)
    with np.load(path + ".npz", allow_pickle=False) as weights:
      result["weights"] = [weights[k] for k in sorted(
          weights.files, key=lambda k: int(k.split("_")[1]))]
    return result
  finally:
    for name in (path, path + ".npz"):
      if os.path.exists(name):
        os.remove(name)


def _row(case, plain):
  devices = sorted(case["slot_bytes"])
  slots = [case["slot_bytes"][d] for d in devices]
  params = case["param_bytes"][devices[0]]
  buffers = case["shard_buffer_bytes"].get(devices[0], 0)
  ratio = slots[0] / plain["slot_bytes"][devices[0]]
  return (f"| {case['model']} | {case['parameters']:,} | {case['replicas']} | "
          f"{'on' if case['sharded'] else 'off'} | {params / MIB:.3f} | "
          f"{' / '.join(f'{s / MIB:.3f}' for s in slots)} | "
          f"{case['computed_slot_bytes'] / MIB:.3f} | {ratio:.3f} | "
          f"{buffers / MIB:.3f} | {case['peak_rss_bytes'] / MIB:.0f} |")


def bench():
  if FLAGS.result_file:
    with open(FLAGS.result_file, "w") as f:
      json.dump(_measure(), f)
    return
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  for name in FLAGS.models:
    if name not in MODELS:
      sys.exit(f"optimizer_sharding.py: error: --models={name} is not one "
               f"of {', '.join(MODELS)}")
  print(f"host: {host.cpu_model()}, {os.cpu_count()} cores, TensorFlow "
        f"{tf.__version__}; {host.load_average()} at the start")
  print(f"Adam, {FLAGS.steps} steps, global batch {FLAGS.global_batch_size};"
        " MiB per device (slots: each device's)\n")
  print("| model | parameters | N | sharded | params MiB | slots MiB | "
        "computed slots MiB | slots / unsharded | shard buffers MiB | "
        "peak RSS MiB |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  cases = []
  for name in FLAGS.models:
    for replicas in FLAGS.replicas:
      plain = _child(name, replicas, False)
      sharded = _child(name, replicas, True)
      difference = max(float(np.abs(a - b).max())
                       for a, b in zip(plain["weights"], sharded["weights"]))
      for case in (plain, sharded):
        case["max_weight_difference"] = difference
        print(_row(case, plain), flush=True)
      cases += [plain, sharded]
  print(f"\nweights after {FLAGS.steps} steps, sharded vs unsharded: max "
        f"|diff| {max(c['max_weight_difference'] for c in cases):.3g}")
  print(f"{host.load_average()} at the end")
  if FLAGS.output_json:
    for case in cases:
      case.pop("weights")
    with open(FLAGS.output_json, "w") as f:
      json.dump(cases, f, indent=1)


main = cli.main_running(bench)

if __name__ == "__main__":
  app.run(main)
