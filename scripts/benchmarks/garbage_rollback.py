"""A small GPT on a corpus with injected garbage: no spike policy vs rollback.

    python scripts/benchmarks/garbage_rollback.py --work_dir=/tmp/garbage

Builds two corpora from the built-in text corpus (the standard library's
top-level *.py files, every 10th file the test split) in `--work_dir`:

  clean/    train/: the training files' bytes, concatenated in sorted file
            order and cut into `--chunk_bytes` files; test/: the test files
            as they are.
  garbage/  the same files, the same sizes (so the same windows and the
            same batches at every step), except the training files of
            `--garbage_groups` of the shuffle groups that the first
            `--train_steps` steps read: in each such group
            `--garbage_fraction` of its files are replaced by garbage of
            the same length, alternately uniform random bytes and the
            file's own bytes shuffled (seed `--garbage_seed`).

Then trains three runs with the same flags: `clean` and `garbage` with
`--spike_policy=none`, `rollback` on the garbage corpus with
`--spike_policy=rollback`. Writes `--output_json` (each run's training
loss per `--summary_every` steps, the final eval loss and perplexity on the
clean test split, the rollbacks of spike_batches.json, goodput.json, the
garbage share of every step's batch, wall times and the load average) and
`--output_png` (the three training-loss curves). `--measured` only reads
the runs already in `--work_dir`.
"""

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from scripts import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()
from scripts.curves import draw  # pylint: disable=g-import-not-at-top

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_string("work_dir", "/tmp/garbage_rollback", "Corpora, runs "
                    "and logs go here.")
flags.DEFINE_integer("chunk_bytes", 2048, "Size of each training file of "
                     "the corpora (small files make small shuffle groups, "
                     "so garbage fills whole batches).")
flags.DEFINE_integer("train_steps", 800, "Steps of each run.")
flags.DEFINE_integer("global_batch_size", 32, "--global_batch_size.")
flags.DEFINE_integer("sequence_length", 64, "--sequence_length.")
flags.DEFINE_list("garbage_groups", ["300", "550"], "Steps whose shuffle "
                  "group is made garbage (one group per step named).")
flags.DEFINE_float("garbage_fraction", 0.75, "The share of a garbage "
                   "group's files replaced.")
flags.DEFINE_integer("garbage_seed", 0, "The garbage's seed.")
flags.DEFINE_list("model_flags", [
    "--model=gpt", "--model_width=64", "--num_heads=4", "--num_layers=2",
    "--optimizer=adam", "--learning_rate=3e-3", "--lr_schedule=cosine",
    "--warmup_steps=50"], "The model and optimizer flags of every run.")
flags.DEFINE_list("spike_flags", ["--spike_factor=2", "--spike_window=50"],
                  "The rollback run's spike flags.")
flags.DEFINE_integer("checkpoint_every", 20, "--checkpoint_every (every "
                     "run; rollback goes back to the last of them).")
flags.DEFINE_bool("measured", False, "Only read the runs in --work_dir.")
flags.DEFINE_string("output_json", os.path.join(
    ROOT, "docs", "results", "long_runs_garbage.json"), "The results.")
flags.DEFINE_string("output_png", os.path.join(
    ROOT, "docs", "results", "long_runs_garbage.png"), "The loss curves.")

RUNS = {"clean": ("clean", "none"), "garbage": ("garbage", "none"),
        "rollback": ("garbage", "rollback")}


def _write(path, data):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(data)


def build_clean(folder):
  """The clean corpus; [(path, bytes)] of its training files, in order."""
  from framework.data import text  # pylint: disable=g-import-not-at-top
  splits = text.scan(None)
  data = b"".join(open(p, "rb").read() for p in splits["train"])
  step = FLAGS.chunk_bytes
  files = []
  for i in range(0, len(data) - step + 1, step):
    path = os.path.join(folder, "train", f"{i // step:05d}.txt")
    files.append((path, data[i:i + step]))
    _write(path, data[i:i + step])
  for p in splits["test"]:
    _write(os.path.join(folder, "test", os.path.basename(p)),
           open(p, "rb").read())
  return files


def batch_files(folder, files, steps):
  """[[training file index of each example] of each step's global batch]:
  the windows of the clean corpus traced back to their file."""
  from framework.data import text  # pylint: disable=g-import-not-at-top
  length = FLAGS.sequence_length
  where = {}
  for i, (_, data) in enumerate(files):
    for k in range((len(data) - 1) // length):
      where.setdefault(data[k * length:(k + 1) * length + 1], i)
  dataset = text.load_text(folder, length).train_dataset(
      FLAGS.global_batch_size)
  steps_files = []
  for tokens, targets in dataset.take(steps):
    windows = np.concatenate([tokens.numpy(), targets.numpy()[:, -1:]], 1)
    steps_files.append([where.get(bytes(w.astype(np.uint8).tolist()), -1)
                        for w in windows])
  return steps_files


def build_garbage(folder, files, steps_files):
  """The garbage corpus; (garbage file indices, what each holds)."""
  rng = np.random.default_rng(FLAGS.garbage_seed)
  chosen, kinds = [], {}
  for n, step in enumerate(int(s) for s in FLAGS.garbage_groups):
    first = set(steps_files[step])
    # The group: every file read in the steps that read this step's files.
    span = [s for s, fs in enumerate(steps_files) if first & set(fs)]
    group = sorted({f for s in range(min(span), max(span) + 1)
                    for f in steps_files[s]} - {-1})
    picked = sorted(rng.choice(group, int(round(FLAGS.garbage_fraction *
                                                len(group))), replace=False))
    for f in picked:
      kinds[int(f)] = "random bytes" if n % 2 == 0 else "shuffled bytes"
    chosen += [int(f) for f in picked]
  for i, (path, data) in enumerate(files):
    if kinds.get(i) == "random bytes":
      data = rng.integers(0, 256, len(data), dtype=np.uint8).tobytes()
    elif kinds.get(i) == "shuffled bytes":
      data = rng.permutation(np.frombuffer(data, np.uint8)).tobytes()
    _write(os.path.join(folder, "train", os.path.basename(path)), data)
  test = os.path.join(os.path.dirname(files[0][0]), "..", "test")
  for name in sorted(os.listdir(test)):
    _write(os.path.join(folder, "test", name),
           open(os.path.join(test, name), "rb").read())
  return sorted(chosen), kinds


def train(name, corpus, policy):
  """Runs train.py; returns (wall seconds, load average before, after)."""
  model_dir = os.path.join(FLAGS.work_dir, "runs", name)
  flags_ = [
      "--dataset=text", f"--data_dir={os.path.join(FLAGS.work_dir, corpus)}",
      f"--model_dir={model_dir}", f"--train_steps={FLAGS.train_steps}",
      f"--global_batch_size={FLAGS.global_batch_size}",
      f"--sequence_length={FLAGS.sequence_length}", "--steps_per_loop=10",
      "--summary_every=10", "--log_every=50",
      f"--checkpoint_every={FLAGS.checkpoint_every}",
      f"--eval_every={FLAGS.train_steps}", f"--spike_policy={policy}",
      *FLAGS.model_flags]
  if policy != "none":
    flags_ += FLAGS.spike_flags
  load = os.getloadavg()[0]
  start = time.time()
  with open(os.path.join(FLAGS.work_dir, f"{name}.log"), "w") as log:
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train.py"),
                    *flags_], stdout=log, stderr=subprocess.STDOUT,
                   check=True)
  return dict(seconds=round(time.time() - start, 1), load_before=load,
              load_after=os.getloadavg()[0], flags=flags_)


def read_run(name):
  """The run's curves, final eval, rollbacks and goodput."""
  model_dir = os.path.join(FLAGS.work_dir, "runs", name)
  points = [json.loads(l) for l in open(os.path.join(model_dir,
                                                     "metrics.jsonl"))]
  # A rolled-back stretch is written again: the last value of a step wins.
  loss = {}
  for p in points:
    if p.get("split") == "train" and p.get("name") == "loss":
      loss[p["step"]] = p["value"]
  evals = [p for p in points if p.get("split") == "eval"]
  final = {p["name"]: p["value"] for p in evals
           if p["step"] == FLAGS.train_steps}
  record = os.path.join(model_dir, "spike_batches.json")
  rollbacks = (json.load(open(record))["rollbacks"]
               if os.path.exists(record) else [])
  goodput = json.load(open(os.path.join(model_dir, "goodput.json")))
  return dict(train_loss=sorted(loss.items()), eval=final,
              rollbacks=rollbacks, goodput=goodput)


def main(argv):
  del argv
  os.makedirs(FLAGS.work_dir, exist_ok=True)
  info_path = os.path.join(FLAGS.work_dir, "runs.json")
  if not FLAGS.measured:
    clean = os.path.join(FLAGS.work_dir, "clean")
    files = build_clean(clean)
    steps_files = batch_files(clean, files, FLAGS.train_steps)
    chosen, kinds = build_garbage(os.path.join(FLAGS.work_dir, "garbage"),
                                  files, steps_files)
    share = [round(sum(f in kinds for f in fs) / len(fs), 3)
             for fs in steps_files]
    info = dict(train_files=len(files), garbage_files=chosen,
                garbage_kinds={str(k): v for k, v in kinds.items()},
                garbage_share_per_step=share, runs={})
    for name, (corpus, policy) in RUNS.items():
      info["runs"][name] = train(name, corpus, policy)
      json.dump(info, open(info_path, "w"), indent=1)
  info = json.load(open(info_path))
  results = dict(info, results={name: read_run(name) for name in RUNS})
  share = info["garbage_share_per_step"]
  results["garbage_steps"] = {
      "at_least_half": [s + 1 for s, v in enumerate(share) if v >= 0.5],
      "any": [s + 1 for s, v in enumerate(share) if v > 0]}
  with open(FLAGS.output_json, "w") as f:
    json.dump(results, f, indent=1)
  draw({name: dict(r["train_loss"]) for name, r in
        results["results"].items()}, FLAGS.output_png,
       "GPT training loss: clean, garbage, garbage + rollback",
       x_label="step", percent=False)
  for name, r in results["results"].items():
    lost = {k: v for k, v in r["goodput"].items()
            if "roll" in k or "spike" in k}
    print(name, r["eval"], len(r["rollbacks"]),
          sum(len(x["batches"]) for x in r["rollbacks"]), lost)


if __name__ == "__main__":
  app.run(main)
