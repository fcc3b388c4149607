"""A subclassed keras.Model given as --model=module:function (weights made
at its first call, no output_shape) trains, resumes, evaluates and
predicts, instead of a KeyError from the optimizer or an AttributeError."""

import textwrap

from tests import helpers

_MODULE = textwrap.dedent("""
    import keras

    class Net(keras.Model):
      def __init__(self, num_classes):
        super().__init__()
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.logits = keras.layers.Dense(num_classes)

      def call(self, x, training=False):
        return self.logits(self.hidden(self.flatten(x)))

    def build(input_shape, num_classes):
      return Net(num_classes)
    """)


def test_a_subclassed_model_trains_resumes_evaluates_predicts(tmp_path):
  (tmp_path / "subnet.py").write_text(_MODULE)
  common = ["--model=subnet:build", "--model_dir=run"]
  train = ["--dataset=synthetic", "--export_saved_model=false",
           "--eval_steps=1"]
  helpers.run_script("train.py", *common, *train, "--train_steps=2",
                     cwd=tmp_path)
  assert (tmp_path / "run" / "ckpt-2.index").exists()
  helpers.run_script("train.py", *common, *train, "--train_steps=3",
                     cwd=tmp_path)
  assert (tmp_path / "run" / "ckpt-3.index").exists()
  evaluated = helpers.run_script("evaluate.py", *common, cwd=tmp_path)
  assert "accuracy" in evaluated.stdout + evaluated.stderr
  predicted = helpers.run_script("predict.py", *common, "--index=0",
                                 cwd=tmp_path)
  assert "predicted:" in predicted.stdout
