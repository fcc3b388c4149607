"""The keras-io ports under scripts/examples run at a few steps: the MNIST
convnet on an MNIST-shaped array file (`--dataset=numpy`) and ResNet50 by
name. (The distillation and GAN ports run in test_trainer_tracking.py,
killed and resumed.)"""

import numpy as np
import pytest

from helpers import ROOT, run_python


def test_mnist_convnet_port_writes_its_data_and_trains(tmp_path):
  script = f"{ROOT}/scripts/examples/mnist_convnet.py"
  data = tmp_path / "mnist.npz"
  proc = run_python(script, f"--write_data={data}", "--synthetic_digits",
                    "--synthetic_examples=256")
  assert proc.returncode == 0, proc.stderr[-2000:]
  with np.load(data) as arrays:
    assert arrays["x_train"].shape == (256, 28, 28, 1)
    assert arrays["x_train"].dtype == np.uint8
  # From another folder: the script puts its own on sys.path.
  proc = run_python(script, f"--data_dir={data}", "--train_steps=4",
                    "--global_batch_size=32", "--strategy=mirrored",
                    "--cpu_devices=2", "--export_saved_model=false",
                    f"--model_dir={tmp_path / 'run'}", cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "final eval" in proc.stderr
  assert (tmp_path / "run" / "ckpt-4.index").exists()


@pytest.mark.slow
def test_resnet50_port_trains_by_name(tmp_path):
  proc = run_python(f"{ROOT}/scripts/examples/resnet50_cifar10.py",
                    "--dataset=synthetic", "--train_steps=1",
                    "--global_batch_size=8", "--eval_steps=1",
                    "--export_saved_model=false",
                    f"--model_dir={tmp_path / 'run'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "final eval" in proc.stderr


@pytest.mark.parametrize("port", [
    "mnist_convnet", pytest.param("distillation", marks=pytest.mark.slow),
    pytest.param("resnet50", marks=pytest.mark.slow)])
def test_port_beside_model_fit_prints_its_table(tmp_path, port):
  proc = run_python(f"{ROOT}/scripts/examples/keras_ports_vs_fit.py",
                    f"--port={port}", "--steps=4", "--teacher_steps=4",
                    "--batch=32", "--examples=256", cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [line for line in proc.stdout.splitlines()
          if line.startswith(f"| {port} |")]
  assert [r.split("|")[2:4] for r in rows] == [
      [" default ", " model.fit "], [" default ", " distloop "],
      [" mirrored ", " model.fit "], [" mirrored ", " distloop "]]
