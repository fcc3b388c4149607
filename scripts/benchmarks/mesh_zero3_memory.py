"""Peak memory of the GPT on `data:2,model:2`: unsharded, ZeRO-2, ZeRO-3.

    python scripts/benchmarks/mesh_zero3_memory.py --json=/tmp/mesh_zero3.json
    python scripts/benchmarks/mesh_zero3_memory.py --baseline_repo=../old

Each setting runs in a fresh process of 4 logical CPU devices (`--one`)
whose CPU allocator keeps statistics (`TF_CPU_ALLOCATOR_USE_BFC=true`:
TensorFlow's default CPU allocator reports none): build the GPT's mesh
trainer (2 copies of a 2-way tensor split) and note the bytes in use (the
variables: weights, shards, slots), run one train step (tracing it), then
`--measured_steps` more, noting the peak bytes in use during them (the
variables plus what a step holds at once: joined weights, gradients,
activations). The mesh is on `CPU:1`..`CPU:4`, so `CPU:0` is the host
and no mesh device. The five devices share the allocator, so its figures
are the process's sum; per device, the bytes of the variables placed on
each (weights of every copy, shards, slots, as they hold them) are
counted. `--baseline_repo`: also run ZeRO-3 from another checkout of
distloop (an older commit), in the same run, for a ratio against it.
"""

import json
import os
import resource
import subprocess
import sys
import time

from absl import app
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from scripts.benchmarks import host  # pylint: disable=g-import-not-at-top,wrong-import-position

flags.DEFINE_integer("width", 512, "Model width.")
flags.DEFINE_integer("num_layers", 8, "Transformer blocks.")
flags.DEFINE_integer("num_heads", 8, "Heads.")
flags.DEFINE_integer("sequence_length", 64, "Tokens per example.")
flags.DEFINE_integer("vocab_size", 256, "Token ids.")
flags.DEFINE_integer("batch", 8, "Global batch (sequences per step).")
flags.DEFINE_integer("measured_steps", 2,
                     "Steps measured after the first (traced) one.")
flags.DEFINE_list("settings", ["unsharded", "zero2", "zero3"],
                  "Which sharding to measure.")
flags.DEFINE_string("baseline_repo", None, "Another distloop checkout: its "
                    "ZeRO-3 is measured too, as `zero3 (baseline)`.")
flags.DEFINE_string("one", None, "Measure this setting (a child run).")
flags.DEFINE_string("repo", ROOT, "The checkout a child run imports.")
flags.DEFINE_string("json", "", "Write the results here too.")
FLAGS = flags.FLAGS

SHARDING = {"unsharded": {},
            "zero2": dict(shard_optimizer_state=True, shard_gradients=True),
            "zero3": dict(shard_optimizer_state=True, shard_gradients=True,
                          shard_parameters=True)}


def _peak_mib():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


MESH = [["/CPU:1", "/CPU:2"], ["/CPU:3", "/CPU:4"]]


def variables_by_device(trainer):
  """{short device: MiB of the trainer's variables placed there}."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  optimizers = [trainer.optimizer] + [c[2] for c in trainer.copies]
  variables = [w for m in [trainer.model] + [c[1] for c in trainer.copies]
               for w in m.weights]
  variables += [v for o in optimizers for v in o.variables]
  state = trainer.copy_sharding
  if state is not None:
    variables += [s for shards in state.shards for s in shards]
    variables += state.slot_variables()
  out, seen = {}, set()
  for v in variables:
    v = getattr(v, "value", v)  # the tf.Variable behind a Keras one
    if id(v) in seen:
      continue
    seen.add(id(v))
    device = "CPU:" + str(tf.DeviceSpec.from_string(v.device).device_index)
    out[device] = out.get(device, 0) + float(
        tf.size(v.read_value())) * v.dtype.size / 2**20
  return dict(sorted(out.items()))


def measure(setting):
  """{built_mib, peak_mib, seconds_per_step, parameters} of one setting."""
  sys.path.insert(0, FLAGS.repo)
  import framework  # pylint: disable=g-import-not-at-top
  framework.configure_cpu_devices(5)
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from framework import model_parallel  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(1)
  model = models.build_model(
      "gpt", (FLAGS.sequence_length,), FLAGS.vocab_size,
      num_layers=FLAGS.num_layers, num_heads=FLAGS.num_heads,
      model_width=FLAGS.width)
  trainer = model_parallel.TensorParallelTrainer(
      model, keras.optimizers.Adam(1e-4), tf.distribute.get_strategy(),
      num_shards=2, replica_devices=MESH,
      global_batch_size=FLAGS.batch, **SHARDING[setting])
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, FLAGS.vocab_size,
                        size=(FLAGS.batch, FLAGS.sequence_length + 1))
  batch = (tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32))
  batches = iter(tf.data.Dataset.from_tensors(batch).repeat())
  memory = tf.config.experimental.get_memory_info
  held = memory("CPU:0")["current"] / 2**20
  trainer.train(batches, 1)  # traced here
  before = memory("CPU:0")["current"] / 2**20
  tf.config.experimental.reset_memory_stats("CPU:0")
  start = time.perf_counter()
  trainer.train(batches, FLAGS.measured_steps)
  seconds = (time.perf_counter() - start) / FLAGS.measured_steps
  return {"held_mib": held, "before_steps_mib": before,
          "by_device_mib": variables_by_device(trainer),
          "steps_peak_mib": memory("CPU:0")["peak"] / 2**20,
          "rss_peak_mib": _peak_mib(), "seconds_per_step": seconds,
          "parameters": int(sum(np.prod(v.shape)
                                for v in model.trainable_variables))}


def _child(setting, repo):
  args = [sys.executable, os.path.abspath(__file__), f"--one={setting}",
          f"--repo={repo}"] + [
              f"--{name}={getattr(FLAGS, name)}"
              for name in ("width", "num_layers", "num_heads",
                           "sequence_length", "vocab_size", "batch",
                           "measured_steps")]
  # TensorFlow's CPU allocator keeps statistics (bytes in use, their peak)
  # only as a BFC allocator; the logical CPU devices share it.
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
             TF_CPU_ALLOCATOR_USE_BFC="true")
  proc = subprocess.run(args, capture_output=True, text=True, env=env,
                        check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode or not lines:
    raise RuntimeError(f"{setting} ({repo}) failed:\n{proc.stderr[-3000:]}")
  return json.loads(lines[-1][len("RESULT "):])


def main(argv):
  del argv
  if FLAGS.one:
    print("RESULT " + json.dumps(measure(FLAGS.one)), flush=True)
    return
  runs = [(s, s, ROOT) for s in FLAGS.settings]
  if FLAGS.baseline_repo:
    runs.append(("zero3 (baseline)", "zero3",
                 os.path.abspath(FLAGS.baseline_repo)))
  results = {}
  load_before = host.load_average()
  for name, setting, repo in runs:
    results[name] = _child(setting, repo)
    print(name, results[name], flush=True)
  load_after = host.load_average()
  first = results[runs[0][0]]
  print(f"\n{load_before} before, {load_after} after")
  print(f"GPT width {FLAGS.width}, {FLAGS.num_layers} blocks, "
        f"{first['parameters']:,} parameters, batch {FLAGS.batch} x "
        f"{FLAGS.sequence_length} tokens, data:2,model:2 in one process\n")
  print("| setting | held by the variables MiB | vs "
        f"{runs[0][0]} | a step's peak MiB | vs {runs[0][0]} | "
        "of which beyond the variables MiB | s/step |")
  print("|---|---|---|---|---|---|---|")
  for name, r in results.items():
    print(f"| {name} | {r['held_mib']:.1f} | "
          f"{r['held_mib'] / first['held_mib']:.2f}x | "
          f"{r['steps_peak_mib']:.1f} | "
          f"{r['steps_peak_mib'] / first['steps_peak_mib']:.2f}x | "
          f"{r['steps_peak_mib'] - r['before_steps_mib']:.1f} | "
          f"{r['seconds_per_step']:.2f} |")
  devices = sorted({d for r in results.values() for d in r["by_device_mib"]})
  print("\nVariables placed on each device, MiB (counted; CPU:0 is the "
        "host):\n")
  print("| setting | " + " | ".join(devices) + " |")
  print("|---|" + "---|" * len(devices))
  for name, r in results.items():
    print(f"| {name} | " + " | ".join(
        f"{r['by_device_mib'].get(d, 0.0):.1f}" for d in devices) + " |")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump({"flags": {k: getattr(FLAGS, k) for k in (
          "width", "num_layers", "num_heads", "sequence_length", "batch")},
                 "host": {"cpu": host.cpu_model(), "cores": os.cpu_count(),
                          "load_before": load_before,
                          "load_after": load_after},
                 "results": results}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
