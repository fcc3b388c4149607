"""A run started from `--model_options=weights=PATH` (keyword-form model)
needs that file at step 0 only: once it has a checkpoint, evaluate.py,
predict.py and a resume rebuild the architecture and restore the run's own
weights, though the file has moved."""

import os

import keras

from helpers import run_script

# A keyword-form builder (as keras.applications models), small enough for
# a few fast steps; it loads `weights` itself, as they do.
BUILDER = '''
import keras

def build(input_shape=None, classes=10, weights=None,
          classifier_activation=None):
  model = keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                            keras.layers.Dense(classes,
                                               activation=classifier_activation)])
  if weights is not None:
    model.load_weights(weights)
  return model
'''


def test_evaluate_predict_and_resume_after_the_weights_file_moved(tmp_path):
  (tmp_path / "tiny_keyword.py").write_text(BUILDER)
  start = tmp_path / "start.weights.h5"
  keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Flatten(),
                    keras.layers.Dense(10)]).save_weights(str(start))
  run = tmp_path / "run"
  train = ["--model=tiny_keyword:build", f"--model_options=weights={start}",
           "--dataset=synthetic", "--global_batch_size=16",
           "--steps_per_loop=2", "--eval_steps=1",
           "--export_saved_model=false", f"--model_dir={run}"]
  run_script("train.py", *train, "--train_steps=2", cwd=str(tmp_path))
  os.rename(start, tmp_path / "moved.weights.h5")

  proc = run_script("evaluate.py", f"--model_dir={run}", "--trust_model_code",
                    cwd=str(tmp_path), check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "(step 2)" in proc.stdout, proc.stdout
  proc = run_script("predict.py", f"--model_dir={run}", "--index=0",
                    "--trust_model_code", cwd=str(tmp_path), check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  proc = run_script("train.py", *train, "--train_steps=4", cwd=str(tmp_path),
                    check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Restored checkpoint" in proc.stderr
  assert (run / "ckpt-4.index").exists()
