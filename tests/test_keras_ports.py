"""The keras-io ports under scripts/examples run at a few steps: the MNIST
convnet on an MNIST-shaped array file (`--dataset=numpy`), ResNet50 by
name, the ViT (its Normalization adapted by the run) on a CIFAR-10 layout
and the VAE on unlabeled digits; and keras_ports_vs_fit.py prints its table
(the GAN's model.fit baseline, ResNet50 and the ViT on a CIFAR-10 layout).
(The distillation and GAN ports run in test_trainer_tracking.py, killed and
resumed.)"""

import numpy as np
import pytest
import tensorflow as tf

from framework.data import datasets
from helpers import ROOT, run_python


def test_mnist_convnet_port_writes_its_data_and_trains(tmp_path):
  script = f"{ROOT}/scripts/examples/mnist_convnet.py"
  data = tmp_path / "mnist.npz"
  proc = run_python(script, f"--write_data={data}", "--synthetic_digits",
                    "--synthetic_examples=256")
  assert proc.returncode == 0, proc.stderr[-2000:]
  with np.load(data, allow_pickle=False) as arrays:
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


def _tiny_cifar10(path):
  """A tiny CIFAR-10 python layout: 64 training, 16 test images."""
  rng = np.random.default_rng(0)
  train = rng.integers(0, 256, (64, 32, 32, 3))
  datasets.write_cifar10(str(path), train, rng.integers(0, 10, 64),
                         rng.integers(0, 256, (16, 32, 32, 3)),
                         rng.integers(0, 10, 16))
  return train


@pytest.mark.slow
def test_vit_port_adapts_its_normalization_on_the_training_images(tmp_path):
  train = _tiny_cifar10(tmp_path / "cifar10")
  proc = run_python(f"{ROOT}/scripts/examples/vit_cifar10.py",
                    f"--data_dir={tmp_path / 'cifar10'}", "--train_steps=2",
                    "--global_batch_size=16", "--export_saved_model=false",
                    # One transformer layer: the adapted mean is the
                    # augmentation's, before any of them.
                    "--model_options=transformer_layers=1",
                    f"--model_dir={tmp_path / 'run'}", cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "adapted Normalization 'normalization' on 64" in proc.stderr
  assert "final eval" in proc.stderr
  # One epoch of 4 batches of 16 is every training image: the kept mean is
  # theirs, per channel, as the model gets them (in [0, 1]).
  reader = tf.train.load_checkpoint(str(tmp_path / "run" / "ckpt-2"))
  [mean] = [reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k.endswith("/adapt_mean/.ATTRIBUTES/VARIABLE_VALUE")]
  np.testing.assert_allclose(mean, (train / 255).mean(axis=(0, 1, 2)),
                             rtol=1e-5)


def test_vae_port_writes_unlabeled_digits_and_trains(tmp_path):
  script = f"{ROOT}/scripts/examples/vae.py"
  data = tmp_path / "digits.npz"
  proc = run_python(script, f"--write_data={data}",
                    "--synthetic_examples=256")
  assert proc.returncode == 0, proc.stderr[-2000:]
  with np.load(data, allow_pickle=False) as arrays:
    assert sorted(arrays) == ["x_test", "x_train"]  # no labels
    assert arrays["x_train"].shape == (256, 28, 28, 1)
  proc = run_python(script, f"--data_dir={data}", "--train_steps=4",
                    "--global_batch_size=32", "--strategy=mirrored",
                    "--cpu_devices=2", f"--model_dir={tmp_path / 'run'}",
                    cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  [final] = [line for line in proc.stderr.splitlines()
             if "final eval" in line]
  assert "'reconstruction'" in final and "'kl'" in final, final
  assert "'accuracy'" not in final, final
  assert (tmp_path / "run" / "ckpt-4.index").exists()


@pytest.mark.parametrize("port", [
    "mnist_convnet", "gan", "vae",
    pytest.param("distillation", marks=pytest.mark.slow),
    pytest.param("resnet50", marks=pytest.mark.slow),
    pytest.param("vit", marks=pytest.mark.slow)])
def test_port_beside_model_fit_prints_its_table(tmp_path, port):
  # resnet50 and vit read CIFAR-10's python layout (--cifar10_dir): a tiny
  # one.
  cifar10 = tmp_path / "cifar10"
  _tiny_cifar10(cifar10)
  proc = run_python(f"{ROOT}/scripts/examples/keras_ports_vs_fit.py",
                    f"--port={port}", "--steps=4", "--teacher_steps=4",
                    "--batch=16", "--examples=256", f"--cifar10_dir={cifar10}",
                    # The ViT's comparison holds at any depth: one layer
                    # traces in a fraction of the time of four.
                    "--vit_layers=1", cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.startswith("host: "), proc.stdout[:300]
  rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines()
          if line.startswith(f"| {port} |")]
  assert [[c.strip() for c in r[2:4]] for r in rows] == [
      ["default", "model.fit"], ["default", "distloop"],
      ["mirrored", "model.fit"], ["mirrored", "distloop"]]
  data = {"resnet50": "CIFAR-10", "vit": "CIFAR-10",
          "vae": "digits, no labels"}.get(port, "digits")
  assert all(r[1].strip() == data for r in rows)
  assert all(float(r[10]) > 0 for r in rows[1::2])  # distloop / fit
  # Train loss / accuracy (the VAE's loss / reconstruction / kl) of the
  # second half, from both sides.
  train = [[float(v) for v in r[5].split("/")] for r in rows]
  assert all(len(t) == (3 if port == "vae" else 2) for t in train), rows
  if port in ("vit", "vae"):
    # On one device the same model, weights, batches and draws give the
    # same train and test losses at a few steps: the ViT only with its
    # Normalization adapted on the same images as keras-io's, the VAE only
    # with its tracked decoder trained.
    fit, ours = rows[0], rows[1]
    assert train[0] == pytest.approx(train[1], abs=1e-3)
    assert float(fit[6]) == pytest.approx(float(ours[6]), abs=1e-3)
  if port == "vae":
    assert all(r[7].strip() == "" for r in rows)  # no accuracy
  if port == "gan":
    # Both sides report d_loss / g_loss; the same models, batches and noise
    # give the same losses at a few steps.
    losses = [[float(v) for v in r[8].split("/")] for r in rows]
    for fit, ours in (losses[0:2], losses[2:4]):
      assert fit == pytest.approx(ours, abs=0.01)


def test_port_names_are_checked(tmp_path):
  proc = run_python(f"{ROOT}/scripts/examples/keras_ports_vs_fit.py",
                    "--port=mnist,gan", cwd=str(tmp_path))
  assert proc.returncode != 0
  assert ("--port=['mnist', 'gan']: unknown port mnist; valid: "
          "mnist_convnet, distillation, resnet50, gan") in proc.stderr


@pytest.mark.slow
def test_train_columns_are_the_second_half_on_both_sides(tmp_path):
  # Past 200 steps a 100-step log interval would end distloop's loops
  # sooner: its last loop, which its train columns are, would be shorter
  # than fit's second half.
  proc = run_python(f"{ROOT}/scripts/examples/keras_ports_vs_fit.py",
                    "--port=mnist_convnet", "--steps=202", "--batch=16",
                    "--examples=256", cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines()
          if line.startswith("| mnist_convnet | digits | default |")]
  fit, ours = ([float(v) for v in r[5].split("/")] for r in rows)
  assert fit == pytest.approx(ours, abs=2e-3)
