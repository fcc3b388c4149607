"""The built-in models' options: the flags `--hidden_units`, `--dropout`, ...

`ExperimentConfig.model_options` holds them (`scripts/config_flags.py`
makes one flag per field), and each builder in this package defaults its
keywords to these fields (`settings.default(ModelOptions, ...)`), so an
option has one default. No TensorFlow here: the flags exist before
TensorFlow loads.
"""

import dataclasses

from framework.settings import POSITIVE, check_settings, setting

@dataclasses.dataclass(frozen=True)
class ModelOptions:
  """The options of the built-in models (`ExperimentConfig.model_options`).

  A model's builder gets the ones its signature names; a model of one's own
  gets its options from `--model_options=key=value,...` (typed from its
  signature, see `models.registry.parse_options`).
  """
  hidden_units: tuple[int, ...] = setting(
      (64, 64), "mlp: hidden layer sizes.", read_by={"model": ("mlp",)})
  dropout: bool = setting(True, "cifar_cnn: keep the Dropout layers.",
                          read_by={"model": ("cifar_cnn",)})
  sync_batch_norm: bool = setting(
      False, "BatchNorm statistics over all replicas (Keras "
      "synchronized=True).", read_by={"model": ("cifar_cnn", "unet")})
  depth: int = setting(4, "unet: down-sampling levels.", flag="unet_depth",
                       minimum=POSITIVE, read_by={"model": ("unet",)})
  width: int = setting(32, "unet: filters of the first level.",
                       flag="unet_width", minimum=POSITIVE,
                       read_by={"model": ("unet",)})
  num_layers: int = setting(2, "gpt: transformer blocks.", minimum=POSITIVE,
                            read_by={"model": ("gpt",)})
  num_heads: int = setting(4, "gpt: attention heads per block (must divide "
                           "--model_width).", minimum=POSITIVE,
                           read_by={"model": ("gpt",)})
  model_width: int = setting(128, "gpt: embedding width.", minimum=POSITIVE,
                             read_by={"model": ("gpt",)})
  vocab_size: int = setting(0, "gpt: vocabulary; 0: the dataset's (256 byte "
                            "tokens for --dataset=text).",
                            read_by={"model": ("gpt",)})
  tie_embeddings: bool = setting(True, "gpt: the output head is the token "
                                 "embedding table (tied), else its own.",
                                 read_by={"model": ("gpt",)})

  def __post_init__(self):
    check_settings(self)

