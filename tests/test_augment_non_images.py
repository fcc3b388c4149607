"""--augment on features that are not images is one line before anything
is written (it was a traceback from inside the flip)."""

import numpy as np

import helpers


def test_augment_on_tabular_features_is_one_line(tmp_path):
  rng = np.random.default_rng(0)
  np.savez(tmp_path / "tab.npz",
           x_train=rng.random((64, 8), np.float32),
           y_train=rng.integers(0, 2, 64),
           x_test=rng.random((16, 8), np.float32),
           y_test=rng.integers(0, 2, 16))
  model_dir = tmp_path / "run"
  for augment in ("flip", "crop_flip"):
    proc = helpers.run_script(
        "train.py", "--model=mlp", "--dataset=numpy",
        f"--data_dir={tmp_path / 'tab.npz'}", f"--augment={augment}",
        "--global_batch_size=16", "--train_steps=1",
        f"--model_dir={model_dir}", check=False)
    helpers.assert_one_line_error(
        proc, "train.py", f"augment={augment} flips and crops images",
        "has features of shape [8]")
    assert not model_dir.exists()
