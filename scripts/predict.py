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

FLAGS = flags.FLAGS

flags.DEFINE_string("model_dir", None, "A training run's directory "
                    "(model_info.json, model.weights.h5).")
flags.DEFINE_string("weights", None, "A .weights.h5 file (default: "
                    "<model_dir>/model.weights.h5), or best: the best "
                    "checkpoint's weights (<model_dir>/best/, kept by "
                    "train.py --best_metric).")
flags.DEFINE_string("model", None, "Model name or package.module:function; "
                    "overrides model_info.json (naming a module trusts its "
                    "code), or names a CIFAR-10 model when there is none.")
flags.DEFINE_bool("trust_model_code", False, "Import the module:function "
                  "that model_info.json names (runs that module's code; off "
                  "by default, as Keras's safe_mode).")
flags.DEFINE_integer("index", None, "Index into the run's own test split "
                     "(its dataset from model_info.json: cifar10, "
                     "synthetic, tfrecord, image_folder, tfds:NAME); prints "
                     "the true label too.")
flags.DEFINE_string("image", None, "A PNG or JPEG file, resized to the "
                    "model's input.")
flags.DEFINE_string("data_dir", None, "The dataset's directory for --index "
                    "(default: the run's; CIFAR-10 without one: Keras's "
                    "cache).")
flags.DEFINE_string("output_json", None, "Also write the result here.")
flags.DEFINE_string("prompt", None, "A language model's run: the text to "
                    "continue (UTF-8 bytes are its tokens).")
flags.DEFINE_integer("max_new_tokens", 200, "--prompt: tokens (bytes) to "
                     "generate.")
flags.DEFINE_float("temperature", 0.0, "--prompt: 0 = greedy (always the "
                   "most likely token); > 0 samples from softmax(logits / "
                   "temperature).")
flags.DEFINE_integer("seed", 0, "--prompt with --temperature > 0: the "
                     "sampling seed (the same seed, the same text).")
flags.DEFINE_string("save_image", None, "Write the classified image (as "
                    "fed to the model) to this PNG.")


def run():
  """Prints (and writes) one prediction; raises DistloopError on bad input."""
  from framework import errors  # pylint: disable=g-import-not-at-top
  # pylint: disable=g-import-not-at-top
  from framework.app import export, prediction
  prediction.use_cpu_only()
  if FLAGS.prompt is not None:
    return _generate(errors, export, prediction)
  if (FLAGS.index is None) == (FLAGS.image is None):
    raise errors.ConfigError("set exactly one of --index (an image of the "
                             "run's test split) and --image (a PNG/JPEG "
                             "file)")
  _check_outputs(errors)
  info, weights = prediction.resolve_model(FLAGS.model_dir, FLAGS.weights,
                                           FLAGS.model)
  # Before any data is read or code imported.
  export.check_model_code(info, FLAGS.trust_model_code)
  true_label = None
  if FLAGS.image is not None:
    image = prediction.load_image(FLAGS.image, info["input_shape"])
    source = FLAGS.image
  else:
    image, true_label, source = prediction.test_example(
        info, FLAGS.index, FLAGS.data_dir)
    if tuple(image.shape) != tuple(info["input_shape"]):
      raise errors.ConfigError(
          f"model={info['model']} takes {tuple(info['input_shape'])} inputs; "
          f"{source} is {image.shape}: use --image")
  model = prediction.load_model(info, weights,
                                trust_model_code=FLAGS.trust_model_code)
  probabilities = prediction.predict(model, image)
  class_names = info["class_names"]
  if true_label is not None and true_label >= len(class_names):
    true_label = None
  lines, summary = prediction.report(probabilities, class_names,
                                     source=source, true_label=true_label)
  summary.update(model=info["model"], weights=weights)
  print("\n".join(lines))
  try:
    if FLAGS.output_json:
      prediction.write_json(FLAGS.output_json, summary)
    if FLAGS.save_image:
      from PIL import Image  # pylint: disable=g-import-not-at-top
      Image.fromarray(image.squeeze()).save(FLAGS.save_image)
  except OSError as e:  # e.g. permission denied, disk full
    raise errors.ConfigError(f"cannot write {e.filename or 'an output'}: "
                             f"{e.strerror or e}") from None


def _generate(errors, export, prediction):
  """Continues --prompt with a language model's run and prints the text."""
  from framework.app import generation  # pylint: disable=g-import-not-at-top
  if FLAGS.index is not None or FLAGS.image is not None:
    raise errors.ConfigError("--prompt generates text; --index and --image "
                             "classify: set one of them")
  if FLAGS.save_image:
    raise errors.ConfigError("--save_image is for --index or --image, not "
                             "--prompt")
  _check_outputs(errors)
  info, weights = prediction.resolve_model(FLAGS.model_dir, FLAGS.weights,
                                           FLAGS.model)
  export.check_model_code(info, FLAGS.trust_model_code)
  generation.check_language_model(info)
  model = prediction.load_model(info, weights,
                                trust_model_code=FLAGS.trust_model_code)
  text = generation.generate_text(
      model, FLAGS.prompt, FLAGS.max_new_tokens,
      temperature=FLAGS.temperature, seed=FLAGS.seed)
  print(text)
  if FLAGS.output_json:
    summary = {"prompt": FLAGS.prompt, "text": text,
               "max_new_tokens": FLAGS.max_new_tokens,
               "temperature": FLAGS.temperature, "seed": FLAGS.seed,
               "model": info["model"], "weights": weights}
    try:
      prediction.write_json(FLAGS.output_json, summary)
    except OSError as e:
      raise errors.ConfigError(f"cannot write {e.filename or 'an output'}: "
                               f"{e.strerror or e}") from None


def _check_outputs(errors):
  """Checks --output_json and --save_image before any work is done."""
  for name in ("output_json", "save_image"):
    path = FLAGS[name].value
    if path is None:
      continue
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
      raise errors.ConfigError(f"--{name}={path!r}: folder {folder!r} does "
                               "not exist")
  if FLAGS.save_image:
    from PIL import Image  # pylint: disable=g-import-not-at-top
    extension = os.path.splitext(FLAGS.save_image)[1].lower()
    known = Image.registered_extensions()
    if extension not in known or known[extension] not in Image.SAVE:
      writable = sorted(e for e, f in known.items() if f in Image.SAVE)
      raise errors.ConfigError(
          f"--save_image={FLAGS.save_image!r}: unknown image extension "
          f"{extension or '(none)'!r}; use e.g. .png or .jpg (PIL writes "
          f"{len(writable)} kinds)")


main = cli.main_running(run)


def entry():
  """Console entry point `distloop-predict`."""
  cli.run_entry_point(main, __name__)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
