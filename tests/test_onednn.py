"""--onednn: TensorFlow's oneDNN CPU kernels chosen per run, before TF loads."""

import re

import pytest

from tests.helpers import run_script

# A conv net, so that the choice changes the kernels that run.
ARGS = ("--model=cifar_cnn", "--dataset=synthetic", "--nodropout",
        "--global_batch_size=16", "--train_steps=3", "--steps_per_loop=3",
        "--eval_every=0", "--checkpoint_every=0", "--noexport_saved_model",
        "--seed=3")


def _run(tmp_path, choice, env=None):
  proc = run_script("train.py", *ARGS, f"--onednn={choice}",
                    f"--model_dir={tmp_path / choice}", env=env)
  log = proc.stdout + proc.stderr
  [state] = re.findall(r"oneDNN CPU kernels: (on|off) \(--onednn=(\w+)\)",
                       log)
  [loss] = re.findall(r"final eval: .*'loss': ([0-9.e+-]+)", log)
  return state, float(loss)


@pytest.mark.slow
def test_onednn_on_and_off_train_the_same_to_rounding(tmp_path):
  # The environment variable the flag replaces must not decide for it.
  env = {"TF_ENABLE_ONEDNN_OPTS": "0"}
  on_state, on_loss = _run(tmp_path, "on", env)
  env = {"TF_ENABLE_ONEDNN_OPTS": "1"}
  off_state, off_loss = _run(tmp_path, "off", env)
  assert on_state == ("on", "on")
  assert off_state == ("off", "off")
  # Different kernels, same training: only rounding differs.
  assert on_loss == pytest.approx(off_loss, rel=1e-4)
