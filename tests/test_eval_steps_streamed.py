"""`--eval_steps` on a dataset streamed from files, under 2 mirrored
replicas: each of the first `eval_steps` global batches feeds every
replica (an input pipeline's elements are per-replica batches)."""

import re

from tests.helpers import run_script


def test_eval_steps_feeds_every_replica(tmp_path):
  proc = run_script(
      "train.py", "--model=gpt", "--dataset=text", "--sequence_length=16",
      "--model_options=num_layers=1,model_width=16,num_heads=2",
      "--global_batch_size=8", "--strategy=mirrored", "--cpu_devices=2",
      "--train_steps=1", "--eval_steps=1", f"--model_dir={tmp_path}",
      # Nothing here reads the export (a GPT's SavedModel is seconds).
      "--export_saved_model=false", timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # One global batch of 8 sequences, 4 on each replica.
  [examples] = re.findall(r"final eval: .*'examples': ([0-9.]+)",
                          proc.stderr)
  assert float(examples) == 8.0
