"""Prediction on a plain CPU from the weights of any training run: classify
one image, or continue a language model's prompt.

    info, weights = resolve_model(model_dir=...)     # model_info.json
    model = load_model(info, weights)                # no strategy
    image, label, source = test_example(info, 3)     # the run's test split
    probabilities = predict(model, image)
    text = generate_text(model, "def ", max_new_tokens=200)   # a text run

The weights file holds values only (no strategy, no replica count), so the
same builder that trained the model under 8 replicas rebuilds it here.

Text: tokens are bytes (`--dataset=text`). The model takes a fixed window
of `sequence_length` tokens: the context is the last `sequence_length`
tokens, padded on the right, and the next token is read at the context's
last real position (the model is causal, so the padding after it changes
nothing). Greedy decoding (`temperature=0`) is deterministic; sampling
draws from softmax(logits / temperature) with a numpy generator seeded by
`seed`, so a seed gives the same text every time.
"""

import json
import os

import numpy as np
import tensorflow as tf

from models import registry
from framework.app import export
from framework.app.config import EvalConfig, PredictConfig
from framework.app.export import (MODEL_INFO_FILE, WEIGHTS_FILE,
                                  build_inference_model, read_model_info,
                                  with_model)
from framework.core.checkpoints import best as best_checkpoint
from framework.data import datasets, mixture
from framework.data.config import InputConfig
from framework.data.inputs import to_float
from framework.errors import (CheckpointError, ConfigError, DataError,
                              check_positive)
from framework.settings import default
from framework.tasks.language_model import TASK

CIFAR10_TEST_SIZE = 10000


def _first_line(error):
  lines = [l for l in str(error).strip().splitlines() if l.strip()]
  for line in lines:  # Keras puts the useful part after a summary line
    if "expected" in line or "shape" in line:
      return line.strip()
  return lines[0].strip() if lines else type(error).__name__


def use_cpu_only():
  """Hides accelerators from TensorFlow (call before any op runs)."""
  try:
    tf.config.set_visible_devices([], "GPU")
  except RuntimeError:  # already initialised: place ops explicitly instead
    pass


def resolve_model(model_dir=None, weights=None, model=None):
  """(model info, weights path) for a run's `model_dir` or a `weights` file.

  The architecture comes from model_info.json in `model_dir` (or beside
  `weights`; `weights="best"`: the run's best checkpoint, see
  `framework.core.checkpoints.best`); `model` overrides its name (and, being named by the user, is
  trusted code: see `export.build_inference_model`), and without any
  model_info.json describes a CIFAR-10 model (32x32x3 inputs, 10 classes).
  """
  if not model_dir and not weights:
    raise ConfigError("set model_dir (a training run's directory) or "
                      "weights (a .weights.h5 file)")
  if model_dir and not os.path.isdir(model_dir):
    raise CheckpointError(f"model_dir={model_dir!r} does not exist")
  if weights == "best":  # the weights evaluation used at the best step
    if not model_dir:
      raise ConfigError("weights=best needs model_dir (the run whose best "
                        "checkpoint to use)")
    weights = best_checkpoint.resolve(model_dir, "weights")
  if weights is None:
    weights = os.path.join(model_dir, WEIGHTS_FILE)
    if not os.path.isfile(weights):
      raise CheckpointError(
          f"model_dir={model_dir!r} has no weights file {WEIGHTS_FILE} "
          "(training writes it when it finishes); pass weights= for another "
          "file")
  elif not os.path.isfile(weights):
    raise CheckpointError(f"weights={weights!r} does not exist")
  info = read_model_info(model_dir or os.path.dirname(weights) or ".")
  if info is None:
    if not model:
      raise CheckpointError(
          f"no {MODEL_INFO_FILE} in {model_dir or os.path.dirname(weights)!r}"
          " to say which model the weights belong to; pass model= (a "
          "CIFAR-10 model name)")
    info = {"model": model, "input_shape": [32, 32, 3],
            "class_names": list(datasets.CIFAR10_CLASSES),
            "dataset": "cifar10"}
  return with_model(info, model), weights


def check_predictable(info):
  """ConfigError unless `info`'s run has outputs predict can read (class
  logits or next-token logits), before any data or code is loaded."""
  if info.get("task") == registry.CUSTOM:
    raise ConfigError(
        f"model={info['model']} was trained with task=custom (not a "
        "classifier: its outputs are the trainer's own), which predict "
        "cannot read as classes; evaluate the run with evaluate.py "
        "(--trust_model_code), or load model.weights.h5 into your model "
        "in your own code")


def load_model(
    info, weights, *,
    trust_model_code=default(EvalConfig, "trust_model_code")):
  """Builds `info`'s model without a strategy and loads `weights` into it
  (`trust_model_code`: see `export.build_inference_model`)."""
  check_predictable(info)
  model = build_inference_model(info, trust_model_code=trust_model_code)
  shape = export.output_shape(model, info)
  if len(shape) != 2 and info.get("task") != "language_model":
    raise ConfigError(f"model={info['model']} predicts per-pixel classes "
                      f"(output shape {shape}); predict "
                      "classifies whole images")
  _check_readable(weights)
  try:
    model.load_weights(weights)
  except (ValueError, OSError, KeyError, TypeError) as e:
    raise CheckpointError(
        f"weights {weights} do not fit model={info['model']} with options "
        f"{info.get('model_options') or {}}: {_first_line(e)}") from None
  return model


def _check_readable(weights):
  """CheckpointError naming `weights` if it is not a complete HDF5 file (a
  damaged file, not a model that does not fit)."""
  import h5py  # pylint: disable=g-import-not-at-top

  def read(_, item):
    if isinstance(item, h5py.Dataset):
      item[()]  # pylint: disable=pointless-statement

  try:
    with h5py.File(weights, "r") as f:
      f.visititems(read)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(
        f"weights file {weights} is damaged ({_first_line(e)}); train again "
        "or restore a copy of the file") from None


def cifar10_test_image(index, data_dir=None):
  """(uint8 image [32, 32, 3], label) of CIFAR-10 test image `index`."""
  if data_dir is None:
    data_dir = os.path.expanduser(datasets.KERAS_CACHE)
  path = os.path.join(data_dir, "test_batch")
  if not os.path.isfile(path):
    raise DataError(f"data_dir={data_dir!r} has no CIFAR-10 test_batch file")
  images, labels = datasets._cifar_batch(path)  # pylint: disable=protected-access
  if not 0 <= index < len(images):
    raise DataError(f"index={index} is out of range: the CIFAR-10 test set in "
                    f"{data_dir} has {len(images)} images (0..{len(images) - 1})")
  return images[index], int(labels[index])


def test_example(info, index, data_dir=None):
  """(features as stored: a uint8 image [H, W, C] or float features, label,
  source text) of test example `index` of
  the run's own dataset (`info`: its model_info.json), as numbered by the
  dataset: CIFAR-10's and arrays' order, a TFRecord's or image folder's
  example index (its order before sharding).

  `data_dir` replaces the run's (e.g. after moving the data); CIFAR-10
  without either reads Keras's cache.
  """
  export.check_own_data(
      info, None, data_dir, what="take test example --index",
      how="classify a file with --image, or give the run's dataset folder "
      "with --data_dir")
  name = info.get("dataset") or "cifar10"
  if data_dir is None:
    data_dir = info.get("data_dir")
  if name == "cifar10":
    image, label = cifar10_test_image(index, data_dir)
    return image, label, f"CIFAR-10 test #{index}"
  dataset = datasets.load_dataset(name, data_dir,
                                  seed=info.get("seed",
                                                default(InputConfig, "seed")),
                                  **(info.get("dataset_options") or {}))
  size = dataset.num_test_examples
  if isinstance(index, bool) or not 0 <= index < size:
    raise DataError(f"index={index} is out of range: the test split of "
                    f"dataset={name} has {size} examples (0..{size - 1})")
  image, label = _stored_test_example(dataset, index)
  if np.ndim(label):
    raise ConfigError(f"dataset={name} has per-pixel labels; predict "
                      "classifies whole images")
  # As stored: uint8 images, or float features (never cast to uint8).
  image = np.asarray(image)
  return image, int(label), f"{name} test #{index}"


def _stored_test_example(dataset, index):
  """(features, label) of test example `index` of `dataset`, as stored."""
  if isinstance(dataset, mixture.MixtureDataset):
    # Numbered as it evaluates: the sources' test splits one after another.
    for source in dataset.sources:
      if index < source.data.num_test_examples:
        return _stored_test_example(source.data, index)
      index -= source.data.num_test_examples
  if hasattr(dataset, "test_x"):  # in memory
    return dataset.test_x[index], dataset.test_y[index]
  return _file_test_example(dataset.test, index)


def _file_test_example(split, index):
  """(image, label) of the record whose example index is `index`, found
  without decoding the other images where the split can tell indices."""
  records = split.read(tf.range(len(split.counts), dtype=tf.int64))
  if split.index is not None:
    for batch in records.batch(1024):
      hits = np.flatnonzero(split.index(batch).numpy() == index)
      if hits.size:
        record = tf.nest.map_structure(lambda r: r[int(hits[0])], batch)
        _, image, label = split.decode(record)
        return image.numpy(), label.numpy()
  else:
    for record in records:
      number, image, label = split.decode(record)
      if int(number) == index:
        return image.numpy(), label.numpy()
  raise DataError(f"the test split has no example with index {index}")


def load_image(path, input_shape):
  """A PNG/JPEG file as uint8 [H, W, C], resized to `input_shape`."""
  from PIL import Image, UnidentifiedImageError  # pylint: disable=g-import-not-at-top
  if len(input_shape) != 3 or input_shape[-1] not in (1, 3):
    raise ConfigError(f"the model takes inputs of shape {tuple(input_shape)}"
                      ", not images: classify a test example with --index")
  if not os.path.exists(path):
    raise DataError(f"image={path!r} does not exist")
  height, width, channels = input_shape
  try:
    with Image.open(path) as image:
      image = image.convert("RGB" if channels == 3 else "L")
      if image.size != (width, height):
        image = image.resize((width, height), Image.BILINEAR)
      array = np.asarray(image, np.uint8)
  except (UnidentifiedImageError, OSError, ValueError) as e:
    raise DataError(f"image={path!r} cannot be read as an image "
                    f"({_first_line(e)})") from None
  return array.reshape(input_shape)


def predict(model, image):
  """Class probabilities (float64, sum 1) for one example: a uint8 image
  [H, W, C] (scaled to [0, 1] as in training) or float features."""
  logits = model(to_float(tf.constant(image[None])), training=False)
  return np.asarray(tf.nn.softmax(logits)[0], np.float64)


def report(probabilities, class_names, *, source, true_label=None):
  """(text lines, JSON-able dict) describing one prediction."""
  best = int(np.argmax(probabilities))
  width = max(len(n) for n in class_names)
  lines = [f"image: {source}" + (f" (true class: {class_names[true_label]})"
                                  if true_label is not None else "")]
  lines += [f"  {name:<{width}}  {p:.6f}" + ("  <-" if i == best else "")
            for i, (name, p) in enumerate(zip(class_names, probabilities))]
  lines.append(f"predicted: {class_names[best]} ({probabilities[best]:.4f})")
  summary = {"source": source,
             "probabilities": {n: float(p) for n, p in
                               zip(class_names, probabilities)},
             "predicted_class": class_names[best], "predicted_index": best}
  if true_label is not None:
    summary["true_class"] = class_names[true_label]
  return lines, summary


def write_json(path, summary):
  with open(path, "w") as f:
    json.dump(summary, f, indent=2)


def check_classifier(info):
  """ConfigError where `info` (model_info.json) describes a language model:
  --index and --image classify images."""
  if info.get("task") == TASK:
    raise ConfigError(
        f"model={info['model']} was trained on dataset={info.get('dataset')}"
        ", a language model: --index and --image classify images; continue "
        "a text with --prompt (e.g. --prompt='def ')")


def check_language_model(info):
  """ConfigError unless `info` (model_info.json) describes a language model."""
  if info.get("task") != TASK:
    raise ConfigError(
        f"--prompt: model={info['model']} was trained on dataset="
        f"{info.get('dataset')}, not a text dataset; generating text needs a "
        "language model (e.g. --model=gpt --dataset=text)")


def generate(model, prompt,
             max_new_tokens=default(PredictConfig, "max_new_tokens"), *,
             temperature=default(PredictConfig, "temperature"),
             seed=default(PredictConfig, "seed")):
  """`prompt` (token ids) followed by `max_new_tokens` generated ones.

  Args:
    model: tokens int32 [1, T] -> logits [1, T, vocab], causal.
    prompt: a non-empty sequence of token ids.
    temperature: 0: the most likely token each time; > 0: sampled.
  """
  check_positive("max_new_tokens", max_new_tokens)
  if not temperature >= 0:
    raise ConfigError(f"temperature={temperature!r} must be >= 0 (0: greedy)")
  tokens = [int(t) for t in prompt]
  if not tokens:
    raise ConfigError("prompt is empty: give at least one token")
  length = int(model.input_shape[-1])
  vocab = int(model.output_shape[-1])
  if max(tokens) >= vocab or min(tokens) < 0:
    raise ConfigError(f"prompt token {max(tokens)} is outside the model's "
                      f"vocabulary of {vocab}")
  rng = np.random.default_rng(seed)
  forward = tf.function(lambda x: model(x, training=False),
                        input_signature=[tf.TensorSpec([1, length],
                                                       tf.int32)])
  for _ in range(max_new_tokens):
    context = tokens[-length:]
    window = np.zeros([1, length], np.int32)
    window[0, :len(context)] = context
    logits = np.asarray(forward(tf.constant(window)))[0, len(context) - 1]
    logits = logits.astype(np.float64)
    if temperature == 0:
      tokens.append(int(np.argmax(logits)))
      continue
    scaled = logits / temperature
    probabilities = np.exp(scaled - scaled.max())
    probabilities /= probabilities.sum()
    tokens.append(int(rng.choice(vocab, p=probabilities)))
  return tokens


def generate_text(model, prompt,
                  max_new_tokens=default(PredictConfig, "max_new_tokens"), *,
                  temperature=default(PredictConfig, "temperature"),
                  seed=default(PredictConfig, "seed")):
  """`prompt` (a str, as UTF-8 bytes) continued by `max_new_tokens` bytes,
  decoded as UTF-8 (invalid sequences replaced)."""
  tokens = generate(model, list(prompt.encode("utf-8")), max_new_tokens,
                    temperature=temperature, seed=seed)
  return bytes(tokens).decode("utf-8", errors="replace")
