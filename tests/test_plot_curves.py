"""plot_curves.py: per-epoch accuracy from real event files, drawn to PNG."""

import json
import os

import numpy as np
from PIL import Image

import framework
import framework.core.summaries  # noqa: F401  (the attribute chain below)
from tests.helpers import run_script


def test_plot_curves_reads_events_and_writes_png(tmp_path):
  model_dir = str(tmp_path)
  train = framework.core.summaries.SummaryWriter(model_dir, "train")
  test = framework.core.summaries.SummaryWriter(model_dir, "eval")
  train.text(0, "flags", framework.core.summaries.markdown_table(
      {"global_batch_size": 100, "model": "cifar_cnn"}))
  # 10 steps per epoch (1000 examples / 100); two train points per epoch.
  for step, acc in ((5, 0.2), (10, 0.4), (15, 0.5), (20, 0.7)):
    train.scalars(step, {"accuracy": acc, "loss": 1.0})
  for step, acc in ((10, 0.3), (20, 0.6)):
    test.scalars(step, {"accuracy": acc})
  train.close()
  test.close()
  png, values = tmp_path / "curves.png", tmp_path / "curves.json"
  proc = run_script("plot_curves.py", f"--model_dir={model_dir}",
                    "--train_examples=1000", f"--output={png}",
                    f"--output_json={values}")
  curves = json.loads(values.read_text())
  assert sorted(curves["train"]) == sorted(curves["test"]) == ["1", "2"]
  np.testing.assert_allclose([curves["train"]["1"], curves["train"]["2"]],
                             [0.3, 0.6], atol=1e-6)
  np.testing.assert_allclose([curves["test"]["1"], curves["test"]["2"]],
                             [0.3, 0.6], atol=1e-6)
  assert "60.00%" in proc.stdout
  image = np.asarray(Image.open(png).convert("RGB"))
  assert image.shape[2] == 3 and image.shape[0] > 100
  # Both curve colours are drawn.
  for color in ((31, 119, 180), (255, 127, 14)):
    assert np.all(image == color, axis=-1).sum() > 50, color
  assert os.path.getsize(png) > 1000
