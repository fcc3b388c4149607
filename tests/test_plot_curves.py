"""plot_curves.py: per-epoch accuracy from real event files, drawn to PNG."""

import json
import os

import numpy as np
from PIL import Image
import pytest

import framework
import framework.core.summaries  # noqa: F401  (the attribute chain below)
from tests import disk_faults
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


def test_a_falling_curve_per_step_on_its_own_scale_with_a_baseline(tmp_path):
  # A language model's perplexity: no batch size recorded, values far
  # above 1 (an accuracy plot would cap them at 100 %), a baseline line.
  model_dir = str(tmp_path / "gpt")
  train = framework.core.summaries.SummaryWriter(model_dir, "train")
  test = framework.core.summaries.SummaryWriter(model_dir, "eval")
  for step, ppl in ((50, 20.0), (100, 14.0), (150, 10.0), (200, 8.0)):
    train.scalars(step, {"perplexity": ppl})
  for step, ppl in ((100, 15.0), (200, 9.5)):
    test.scalars(step, {"perplexity": ppl})
  train.close()
  test.close()
  values = tmp_path / "ppl.json"
  proc = run_script("plot_curves.py", f"--model_dir={model_dir}",
                    "--tag=perplexity", "--x_axis=step", "--baseline=23.13",
                    "--baseline_name=unigram", f"--output_json={values}",
                    cwd=str(tmp_path))
  curves = json.loads(values.read_text())
  assert curves["train"] == {"50": 20.0, "100": 14.0, "150": 10.0,
                             "200": 8.0}
  assert curves["test"] == {"100": 15.0, "200": 9.5}
  assert curves["unigram"] == {"0": 23.13, "200": 23.13}
  assert "%" not in proc.stdout and "9.5" in proc.stdout, proc.stdout
  png = os.path.join(model_dir, "perplexity.png")
  image = np.asarray(Image.open(png).convert("RGB"))
  # Train, test and the baseline are drawn inside the plot's frame: the
  # values are on their own scale, not clipped at 1.
  for color in ((31, 119, 180), (255, 127, 14), (44, 160, 44)):
    rows = np.flatnonzero(np.all(image == color, axis=-1).any(axis=1))
    assert len(rows) > 0, color
    assert 40 <= rows.min() and rows.max() <= image.shape[0] - 60, color
  # The train curve spans most of the height (20 -> 8 on a ~8..24 axis).
  train_rows = np.flatnonzero(
      np.all(image == (31, 119, 180), axis=-1)[:, 100:-200].any(axis=1))
  assert train_rows.max() - train_rows.min() > 200, train_rows


def test_a_tag_the_run_never_logged_is_one_line(tmp_path):
  model_dir = str(tmp_path)
  train = framework.core.summaries.SummaryWriter(model_dir, "train")
  train.scalars(10, {"loss": 1.0})
  train.close()
  proc = run_script("plot_curves.py", f"--model_dir={model_dir}",
                    "--tag=perplexity", check=False)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1] == (
      f"plot_curves.py: error: no 'perplexity' scalars in {model_dir}/train "
      "or /eval (its tags: loss)"), proc.stderr[-500:]


def test_a_full_disk_is_one_line_and_the_old_png_stays(tmp_path):
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  with disk_faults.mounted(model_dir, "size=2m") as mounted:
    if not mounted:
      pytest.skip("mounting a tmpfs is not permitted here")
    train = framework.core.summaries.SummaryWriter(str(model_dir), "train")
    train.scalars(10, {"loss": 2.0})
    train.close()
    png = str(model_dir / "loss.png")
    run_script("plot_curves.py", f"--model_dir={model_dir}", "--tag=loss",
               "--x_axis=step")
    before = open(png, "rb").read()
    disk_faults.fill(str(model_dir), 0)
    proc = run_script("plot_curves.py", f"--model_dir={model_dir}",
                      "--tag=loss", "--x_axis=step", check=False)
    after = open(png, "rb").read()
    leftovers = sorted(os.listdir(model_dir))
  assert proc.returncode == 1, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last == (f"plot_curves.py: error: cannot write {png} (No space left "
                  "on device); the previous version is unchanged"), last
  assert after == before
  assert leftovers == ["filler", "loss.png", "train"], leftovers


def test_histograms_beside_the_scalars_are_left_out(tmp_path):
  """A run with histograms in train/ (`--log_layer_norms`) still plots."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  model_dir = str(tmp_path)
  train = framework.core.summaries.SummaryWriter(model_dir, "train")
  for step, loss in ((1, 3.0), (2, 2.0)):
    train.scalars(step, {"loss": loss})
  writer = tf.summary.create_file_writer(os.path.join(model_dir, "train"))
  with writer.as_default():
    tf.summary.histogram("layer_norms_hist/grad", [0.1, 0.2, 0.3], step=2)
  writer.flush()
  train.close()
  values = tmp_path / "curves.json"
  run_script("plot_curves.py", f"--model_dir={model_dir}", "--tag=loss",
             "--x_axis=step", f"--output={tmp_path / 'loss.png'}",
             f"--output_json={values}")
  curves = json.loads(values.read_text())
  assert curves["train"] == {"1": 3.0, "2": 2.0}
