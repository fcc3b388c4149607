"""Train under MirroredStrategy, then classify on a CPU-only process."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
import framework.app.export  # noqa: F401  (the attribute chain below)
from framework.app import experiment, export, prediction
from tests.helpers import run_script
from tests.shared_strategy import mirrored

NUM_TEST = 16


class RecordingTrainer(framework.Trainer):
  """Keeps the trainer, so the test can query the training process's model."""
  instances = []

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    RecordingTrainer.instances.append(self)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A cifar_cnn trained 4 steps on 2 replicas, plus its own predictions."""
  root = tmp_path_factory.mktemp("predict")
  data = framework.data.datasets.synthetic(num_train=64, num_test=NUM_TEST, seed=1)
  data_dir = str(root / "cifar")
  framework.data.datasets.write_cifar10(data_dir, data.train_x, data.train_y, data.test_x,
                          data.test_y)
  model_dir = str(root / "run")
  config = framework.ExperimentConfig(
      model="cifar_cnn", dataset="cifar10", data_dir=data_dir,
      model_dir=model_dir, strategy="mirrored", global_batch_size=16,
      train_steps=4, loop=framework.LoopConfig(train_steps=4,
                                               steps_per_loop=4))
  experiment.run(config, trainer_cls=RecordingTrainer, strategy=mirrored())
  trainer = RecordingTrainer.instances[-1]
  assert trainer.num_replicas == 2
  # The training process's model (mirrored variables) on test images.
  images = data.test_x[:6]
  expected = tf.nn.softmax(trainer.model(images.astype(np.float32) / 255.0,
                                         training=False)).numpy()
  png = str(root / "test5.png")
  from PIL import Image  # pylint: disable=g-import-not-at-top
  Image.fromarray(data.test_x[5]).save(png)
  return dict(root=root, data_dir=data_dir, model_dir=model_dir,
              expected=expected, png=png, labels=data.test_y)


def _probabilities(summary):
  return np.array(list(summary["probabilities"].values()))


def test_run_writes_weights_info_and_saved_model(trained):
  model_dir = trained["model_dir"]
  assert os.path.isfile(os.path.join(model_dir, export.WEIGHTS_FILE))
  info = export.read_model_info(model_dir)
  assert info["model"] == "cifar_cnn"
  assert info["class_names"] == list(framework.data.datasets.CIFAR10_CLASSES)
  assert info["input_shape"] == [32, 32, 3]
  loaded = tf.saved_model.load(os.path.join(model_dir, export.EXPORT_DIR))
  images = framework.data.datasets.load_cifar10(trained["data_dir"]).test_x[:6]
  out = loaded.signatures["serving_default"](images=tf.constant(images))
  np.testing.assert_allclose(out["probabilities"].numpy(),
                             trained["expected"], atol=1e-5)
  names = [n.decode() for n in out["class_name"].numpy()]
  assert names == [info["class_names"][i]
                   for i in trained["expected"].argmax(1)]


def test_predict_index_matches_training_process(trained):
  out_json = str(trained["root"] / "index3.json")
  proc = run_script("predict.py", f"--model_dir={trained['model_dir']}",
                    "--index=3", f"--data_dir={trained['data_dir']}",
                    f"--output_json={out_json}")
  with open(out_json) as f:
    summary = json.load(f)
  probabilities = _probabilities(summary)
  assert abs(probabilities.sum() - 1.0) < 1e-6
  np.testing.assert_allclose(probabilities, trained["expected"][3], atol=1e-5)
  assert list(summary["probabilities"]) == list(
      framework.data.datasets.CIFAR10_CLASSES)
  best = framework.data.datasets.CIFAR10_CLASSES[int(trained["expected"][3].argmax())]
  assert summary["predicted_class"] == best
  assert summary["true_class"] == framework.data.datasets.CIFAR10_CLASSES[
      trained["labels"][3]]
  # The printed lines say the same: one per class, then the winner.
  lines = proc.stdout.strip().splitlines()
  printed = [float(l.split()[1]) for l in lines[1:11]]
  np.testing.assert_allclose(printed, probabilities, atol=1e-6)
  assert lines[-1].startswith(f"predicted: {best} ")


def test_predict_image_file(trained):
  out_json = str(trained["root"] / "png.json")
  run_script("predict.py", f"--model_dir={trained['model_dir']}",
             f"--image={trained['png']}", f"--output_json={out_json}")
  with open(out_json) as f:
    probabilities = _probabilities(json.load(f))
  np.testing.assert_allclose(probabilities, trained["expected"][5], atol=1e-5)


def test_weights_of_another_model_is_one_error(tmp_path):
  mlp = framework.app.export.build_inference_model(
      {"model": "mlp", "input_shape": [32, 32, 3], "class_names": list("abc")})
  path = str(tmp_path / "mlp.weights.h5")
  mlp.save_weights(path)
  info = {"model": "cifar_cnn", "input_shape": [32, 32, 3],
          "class_names": list(framework.data.datasets.CIFAR10_CLASSES)}
  with pytest.raises(framework.CheckpointError, match="do not fit model=cifar_cnn"):
    prediction.load_model(info, path)


@pytest.fixture(scope="module")
def bad_inputs(trained):
  root = trained["root"]
  garbage = root / "garbage.png"
  garbage.write_text("not an image")
  empty = root / "empty_run"
  empty.mkdir()
  mlp = framework.app.export.build_inference_model(
      {"model": "mlp", "input_shape": [32, 32, 3],
       "class_names": list(framework.data.datasets.CIFAR10_CLASSES)})
  mlp_weights = str(root / "mlp.weights.h5")
  mlp.save_weights(mlp_weights)
  run = f"--model_dir={trained['model_dir']}"
  return {
      "missing image": ([run, f"--image={root / 'nope.png'}"],
                        "does not exist"),
      "unreadable image": ([run, f"--image={garbage}"],
                           "cannot be read as an image"),
      "index out of range": ([run, f"--index={NUM_TEST}",
                              f"--data_dir={trained['data_dir']}"],
                             "out of range"),
      "no weights": ([f"--model_dir={empty}", "--index=0"],
                     "has no weights file"),
      "weights of another model": ([run, f"--weights={mlp_weights}",
                                    "--index=0",
                                    f"--data_dir={trained['data_dir']}"],
                                   "do not fit model=cifar_cnn"),
  }


@pytest.mark.parametrize("case", ["missing image", "unreadable image",
                                  "index out of range", "no weights",
                                  "weights of another model"])
def test_bad_input_is_one_line_and_nonzero_exit(bad_inputs, case):
  args, message = bad_inputs[case]
  proc = run_script("predict.py", *args, check=False)
  assert proc.returncode != 0
  errors = [l for l in proc.stderr.splitlines() if "predict.py:" in l]
  assert len(errors) == 1, proc.stderr[-2000:]
  assert errors[0].startswith("predict.py: error: ")
  assert message in errors[0]
  assert proc.stderr.strip().splitlines()[-1] == errors[0]
  assert "Traceback" not in proc.stderr
