"""Model builders by name: `build_model("cifar_cnn", (32, 32, 3), 10)`."""

from models import cifar_cnn, gpt, gpt_parallel, mlp, unet  # noqa: F401  (registers the builders and the gpt split)
from models.registry import (build_model, check_task, get_builder,
                             model_names, register)

__all__ = ["build_model", "check_task", "get_builder", "model_names",
           "register"]
