"""What `evaluate.py` evaluates: `EvalConfig`, its settings declared once.

`scripts/evaluate.py` makes its flags from these fields
(`scripts/config_flags.py`); `framework.app.evaluation` evaluates with
the config. No TensorFlow here: the flags exist before TensorFlow loads.
"""

import dataclasses
import os
import re

from framework.distribute.choices import EVAL_STRATEGIES
from framework.errors import ConfigError
from framework.settings import POSITIVE, check_settings, setting

DEFAULT_EVAL_NAME = "standalone"
# What only `evaluate.py --watch` reads (`setting(read_by=...)`).
_WATCH = {"watch": ("true",)}


def _local_path(path):
  return os.path.realpath(path) if "://" not in path else path.rstrip("/")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """What to evaluate, where, and how long to wait for new checkpoints.

  Attributes:
    model_dir: the training run's directory.
    checkpoint: a checkpoint path (`.../ckpt-200`); default: the latest.
    strategy, tpu: as for training (any strategy but parameter_server).
    dataset, data_dir, global_batch_size: default to the run's.
    eval_dir: TensorBoard directory; default model_dir/eval_<eval_name>.
      Never the run's own model_dir/eval (its training curves).
    eval_name: names the default eval_dir (letters, digits, `_.-`).
    poll_seconds: how often `watch` looks for a new checkpoint.
    timeout_seconds: `watch` stops after this long with nothing new.
    model: the model (registered name or `module:function`) instead of
      model_info.json's; naming it trusts its code.
    trust_model_code: import the `module:function` model_info.json names
      (off by default: see `export.build_inference_model`).
  """
  model_dir: str = setting(help="The training run's directory.")
  checkpoint: str | None = setting(
      None, "A checkpoint path (.../ckpt-N); default: the latest in "
      "--model_dir.")
  strategy: str = setting("default", "tf.distribute strategy for "
                          "evaluation.", choices=EVAL_STRATEGIES)
  tpu: str | None = setting(None, "TPU for --strategy=tpu.",
                            read_by={"strategy": ("tpu",)})
  dataset: str | None = setting(None, "Default: the run's dataset.")
  data_dir: str | None = setting(None, "Default: the run's data_dir.")
  global_batch_size: int | None = setting(None, "Default: the run's.",
                                          minimum=POSITIVE)
  eval_dir: str | None = setting(
      None, "TensorBoard directory (default: <model_dir>/eval_<eval_name>); "
      "never the run's own <model_dir>/eval.")
  eval_name: str = setting(DEFAULT_EVAL_NAME, "Names the default "
                           "--eval_dir: <model_dir>/eval_<eval_name>.")
  poll_seconds: float = setting(
      5.0, "--watch: seconds between looks for a new checkpoint.",
      read_by=_WATCH)
  timeout_seconds: float = setting(
      3600.0, "--watch: stop after this long without a new checkpoint "
      "(exit 1 if none came at all).", read_by=_WATCH)
  model: str | None = setting(
      None, "The model (registered name or package.module:function) instead "
      "of model_info.json's; naming a module trusts its code.")
  trust_model_code: bool = setting(
      False, "Import the module:function that model_info.json names (runs "
      "that module's code; off by default, as Keras's safe_mode).")

  def __post_init__(self):
    if not self.model_dir:
      raise ConfigError("model_dir must be set")
    check_settings(self)
    for name in ("poll_seconds", "timeout_seconds"):
      if not getattr(self, name) > 0:
        raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.eval_name or "") or (
        self.eval_name in (".", "..")):
      raise ConfigError(f"eval_name={self.eval_name!r} must be a folder name "
                        "(letters, digits, _ . -), e.g. "
                        f"{DEFAULT_EVAL_NAME}")
    own = os.path.join(self.model_dir, "eval")
    if _local_path(self.summary_dir) == _local_path(own):
      raise ConfigError(
          f"eval_dir={self.eval_dir!r} is the training run's own evaluation "
          f"curves ({own}); an evaluator writes elsewhere (default: "
          f"{os.path.join(self.model_dir, 'eval_' + DEFAULT_EVAL_NAME)})")

  @property
  def summary_dir(self):
    """Where the evaluator's TensorBoard summaries go."""
    return self.eval_dir or os.path.join(self.model_dir,
                                         "eval_" + self.eval_name)
