"""What `scripts/predict.py` predicts from: its settings, declared once.

`scripts/predict.py` makes its flags from `PredictConfig`'s fields
(`scripts/config_flags.py`), and `generation.generate` defaults its
keywords to the same fields. No TensorFlow here: the flags exist before
TensorFlow loads.
"""

import dataclasses

from framework.app.eval_config import EvalConfig
from framework.errors import ConfigError
from framework.settings import check_settings, same_as, setting


@dataclasses.dataclass(frozen=True)
class PredictConfig:
  """One prediction on the CPU from a training run's weights.

  Attributes:
    model_dir: the training run's directory (model_info.json, weights).
    weights: a .weights.h5 file, or `best` (default: the run's own).
    model, trust_model_code: as for `EvalConfig`.
    index, image: classify an example of the run's test split, or a file.
    data_dir: the dataset's directory for `index` (default: the run's).
    output_json, save_image: where the result and the image also go.
    prompt, max_new_tokens, temperature, seed: a language model's run
      continues `prompt` (`generation.generate_text`).
  """
  model_dir: str | None = setting(
      None, "A training run's directory (model_info.json, model.weights.h5).")
  weights: str | None = setting(
      None, "A .weights.h5 file (default: <model_dir>/model.weights.h5), or "
      "best: the best checkpoint's weights (<model_dir>/best/, kept by "
      "train.py --best_metric).")
  model: str | None = setting(
      None, "Model name or package.module:function; overrides "
      "model_info.json (naming a module trusts its code), or names a "
      "CIFAR-10 model when there is none.")
  trust_model_code: bool = same_as(EvalConfig, "trust_model_code")
  index: int | None = setting(
      None, "Index into the run's own test split (its dataset from "
      "model_info.json: cifar10, synthetic, tfrecord, image_folder, "
      "tfds:NAME); prints the true label too.")
  image: str | None = setting(None, "A PNG or JPEG file, resized to the "
                              "model's input.")
  data_dir: str | None = setting(
      None, "The dataset's directory for --index (default: the run's; "
      "CIFAR-10 without one: Keras's cache).")
  output_json: str | None = setting(None, "Also write the result here.")
  prompt: str | None = setting(
      None, "A language model's run: the text to continue (UTF-8 bytes are "
      "its tokens).")
  max_new_tokens: int = setting(200, "--prompt: tokens (bytes) to generate.")
  temperature: float = setting(
      0.0, "--prompt: 0 = greedy (always the most likely token); > 0 "
      "samples from softmax(logits / temperature).")
  seed: int = setting(0, "--prompt with --temperature > 0: the sampling "
                      "seed (the same seed, the same text).")
  save_image: str | None = setting(None, "Write the classified image (as "
                                   "fed to the model) to this PNG.")

  def __post_init__(self):
    check_settings(self)
    if not self.temperature >= 0:
      raise ConfigError(f"temperature={self.temperature!r} must be >= 0 (0: "
                        "greedy)")
