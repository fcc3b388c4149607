"""A model whose weights cannot be allocated (widths from a typo, or from
an edited model_info.json) is one line naming the model and its options,
not TensorFlow's ResourceExhaustedError traceback (TensorFlow's
allocator retries for 10 s before it gives up: the test takes ~20 s)."""

from tests import helpers

_HUGE = 10**12


def test_train_script_is_one_line_and_writes_nothing(tmp_path):
  model_dir = tmp_path / "run"
  before = helpers.snapshot(str(model_dir))
  proc = helpers.run_script(
      "train.py", "--model=mlp", "--dataset=synthetic",
      f"--hidden_units={_HUGE}", "--train_steps=1", "--noexport_saved_model",
      f"--model_dir={model_dir}", check=False)
  helpers.assert_one_line_error(proc, "train.py", "model='mlp'",
                                str(_HUGE), unchanged=before)
