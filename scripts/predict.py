"""Classifies one image on the CPU with the weights of any training run.

    python scripts/predict.py --model_dir=runs/cifar --index=111
        # the run's own test split (any dataset); --data_dir if it moved
    python scripts/predict.py --model_dir=runs/cifar --image=cat.png \
        --output_json=cat.json

The model is rebuilt from model_dir/model_info.json without a strategy and
loads model_dir/model.weights.h5, whatever strategy and replica count wrote
them. Prints each class's probability and the predicted class.

    python scripts/predict.py --model_dir=runs/gpt --prompt="def " \
        --max_new_tokens=200 [--temperature=0.8 --seed=1]

A language model (`--model=gpt --dataset=text`) continues `--prompt`
instead: greedy with `--temperature=0`, else sampled (the same text for
the same `--seed`).
"""

import os

from absl import app  # pylint: disable=g-import-not-at-top
try:  # Installed: the package distloop_cli.
  from . import cli  # pylint: disable=g-import-not-at-top
except ImportError:  # python scripts/<app>.py
  from distloop_cli import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()  # Before TensorFlow is imported.
from absl import flags
try:  # No TensorFlow in them: the flags come first.
  from . import config_flags  # pylint: disable=g-import-not-at-top
except ImportError:
  from distloop_cli import config_flags  # pylint: disable=g-import-not-at-top
from framework.app.config import PredictConfig  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS

# The settings of a prediction: one flag per field of PredictConfig
# (framework/app/config.py; see scripts/config_flags.py).
PREDICT_FLAGS = config_flags.define_flags(cls=PredictConfig)


def run():
  """Prints (and writes) one prediction; raises DistloopError on bad input."""
  from framework import errors  # pylint: disable=g-import-not-at-top
  # pylint: disable=g-import-not-at-top
  from framework.app import export, prediction
  prediction.use_cpu_only()
  config = config_flags.build_config(PredictConfig)
  if config.prompt is not None:
    return _generate(config, errors, export, prediction)
  if (config.index is None) == (config.image is None):
    raise errors.ConfigError("set exactly one of --index (an image of the "
                             "run's test split) and --image (a PNG/JPEG "
                             "file)")
  _check_outputs(config, errors)
  info, weights = prediction.resolve_model(config.model_dir, config.weights,
                                           config.model)
  # Before any data is read or code imported.
  export.check_model_code(info, config.trust_model_code)
  true_label = None
  prediction.check_predictable(info)
  prediction.check_classifier(info)
  if config.image is not None:
    image = prediction.load_image(config.image, info["input_shape"])
    source = config.image
  else:
    image, true_label, source = prediction.test_example(
        info, config.index, config.data_dir)
    if tuple(image.shape) != tuple(info["input_shape"]):
      raise errors.ConfigError(
          f"model={info['model']} takes {tuple(info['input_shape'])} inputs; "
          f"{source} is {image.shape}: use --image")
  model = prediction.load_model(info, weights,
                                trust_model_code=config.trust_model_code)
  probabilities = prediction.predict(model, image)
  class_names = info["class_names"]
  if true_label is not None and true_label >= len(class_names):
    true_label = None
  lines, summary = prediction.report(probabilities, class_names,
                                     source=source, true_label=true_label)
  summary.update(model=info["model"], weights=weights)
  print("\n".join(lines))
  try:
    if config.output_json:
      prediction.write_json(config.output_json, summary)
    if config.save_image:
      from PIL import Image  # pylint: disable=g-import-not-at-top
      Image.fromarray(image.squeeze()).save(config.save_image)
  except OSError as e:  # e.g. permission denied, disk full
    raise errors.ConfigError(f"cannot write {e.filename or 'an output'}: "
                             f"{e.strerror or e}") from None


def _generate(config, errors, export, prediction):
  """Continues --prompt with a language model's run and prints the text."""
  if config.index is not None or config.image is not None:
    raise errors.ConfigError("--prompt generates text; --index and --image "
                             "classify: set one of them")
  if config.save_image:
    raise errors.ConfigError("--save_image is for --index or --image, not "
                             "--prompt")
  _check_outputs(config, errors)
  info, weights = prediction.resolve_model(config.model_dir, config.weights,
                                           config.model)
  export.check_model_code(info, config.trust_model_code)
  prediction.check_language_model(info)
  model = prediction.load_model(info, weights,
                                trust_model_code=config.trust_model_code)
  text = prediction.generate_text(
      model, config.prompt, config.max_new_tokens,
      temperature=config.temperature, seed=config.seed)
  print(text)
  if config.output_json:
    summary = {"prompt": config.prompt, "text": text,
               "max_new_tokens": config.max_new_tokens,
               "temperature": config.temperature, "seed": config.seed,
               "model": info["model"], "weights": weights}
    try:
      prediction.write_json(config.output_json, summary)
    except OSError as e:
      raise errors.ConfigError(f"cannot write {e.filename or 'an output'}: "
                               f"{e.strerror or e}") from None


def _check_outputs(config, errors):
  """Checks --output_json and --save_image before any work is done."""
  for name in ("output_json", "save_image"):
    path = getattr(config, name)
    if path is None:
      continue
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
      raise errors.ConfigError(f"--{name}={path!r}: folder {folder!r} does "
                               "not exist")
  if config.save_image:
    from PIL import Image  # pylint: disable=g-import-not-at-top
    extension = os.path.splitext(config.save_image)[1].lower()
    known = Image.registered_extensions()
    if extension not in known or known[extension] not in Image.SAVE:
      writable = sorted(e for e, f in known.items() if f in Image.SAVE)
      raise errors.ConfigError(
          f"--save_image={config.save_image!r}: unknown image extension "
          f"{extension or '(none)'!r}; use e.g. .png or .jpg (PIL writes "
          f"{len(writable)} kinds)")


main = cli.main_running(run)


def entry():
  """Console entry point `distloop-predict`."""
  cli.run_entry_point(main, __name__)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
