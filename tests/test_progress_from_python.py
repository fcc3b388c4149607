"""`framework.run` from a plain `python` process prints the progress and
eval lines (as train.py does), unless the user configured logging."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT

_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
{logging_setup}
import framework
framework.run(framework.ExperimentConfig(
    model="mlp", dataset="synthetic", model_dir={model_dir!r},
    global_batch_size=32, train_steps=4, export_saved_model=False,
    model_options={{"hidden_units": (8,)}},
    loop=framework.LoopConfig(train_steps=4, log_every=2)))
"""


def _run(model_dir, logging_setup=""):
  proc = subprocess.run(
      [sys.executable, "-c", _SCRIPT.format(root=ROOT, model_dir=model_dir,
                                            logging_setup=logging_setup)],
      capture_output=True, text=True, timeout=300,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc.stderr


@pytest.mark.slow
def test_run_from_plain_python_prints_progress(tmp_path):
  err = _run(str(tmp_path / "a"))
  assert "train step 4/4: loss=" in err
  assert "eval  step 4: accuracy=" in err


@pytest.mark.slow
def test_logging_the_user_configured_is_respected(tmp_path):
  err = _run(str(tmp_path / "b"), "import logging\n"
             "logging.basicConfig(level=logging.WARNING)")
  assert "train step" not in err and "eval  step" not in err
