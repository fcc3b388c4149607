"""A language-model run: gpt on text trains in nats/token with perplexity in
TensorBoard, evaluate.py agrees, predict.py continues a prompt (greedy is
deterministic, sampling is seeded), wrong pairings are one line."""

import json
import math
import os

import numpy as np
import pytest
import tensorflow as tf

import framework
from framework.app import experiment, prediction
from tests.helpers import assert_one_line_error, run_script, snapshot
from tests.test_controller import scalars
from tests.test_text_dataset import write_corpus

STEPS = 6
GPT = ["--model=gpt", "--num_layers=1", "--num_heads=2", "--model_width=16",
       "--sequence_length=16"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """gpt trained STEPS steps on a small corpus, in process; (config,
  results)."""
  root = tmp_path_factory.mktemp("lm")
  write_corpus(str(root / "corpus"), num_files=20)
  config = framework.ExperimentConfig(
      model="gpt", dataset="text", data_dir=str(root / "corpus"),
      model_dir=str(root / "run"), global_batch_size=8, train_steps=STEPS,
      model_options=dict(num_layers=1, num_heads=2, model_width=16),
      dataset_options=dict(sequence_length=16),
      loop=framework.LoopConfig(train_steps=STEPS, steps_per_loop=3,
                                summary_every=3))
  results = experiment.run(config)
  return config, results


def test_loss_is_nats_per_token_and_perplexity_is_logged(run):
  config, results = run
  assert set(results) == {"loss", "accuracy", "perplexity", "examples"}
  # Barely trained: near the uniform loss over 256 bytes.
  assert 3.0 < results["loss"] < math.log(256) + 0.5
  assert results["perplexity"] == pytest.approx(math.exp(results["loss"]))
  evals = scalars(os.path.join(config.model_dir, "eval"), "perplexity")
  losses = scalars(os.path.join(config.model_dir, "eval"), "loss")
  assert evals[STEPS] == pytest.approx(math.exp(losses[STEPS]), rel=1e-5)
  train = scalars(os.path.join(config.model_dir, "train"), "perplexity")
  train_loss = scalars(os.path.join(config.model_dir, "train"), "loss")
  assert sorted(train) == [3, 6]
  assert train[6] == pytest.approx(math.exp(train_loss[6]), rel=1e-5)
  info = json.load(open(os.path.join(config.model_dir, "model_info.json")))
  assert info["task"] == "language_model"
  assert info["dataset_options"]["sequence_length"] == 16


def test_eval_loss_is_the_mean_over_every_test_token(run):
  config, results = run
  dataset = framework.data.datasets.load_dataset(
      "text", config.data_dir, sequence_length=16)
  info, weights = prediction.resolve_model(config.model_dir)
  model = prediction.load_model(info, weights)
  total, count = 0.0, 0
  for tokens, targets in dataset.eval_dataset(5, pad=False):
    loss = tf.keras.losses.sparse_categorical_crossentropy(
        targets, model(tokens), from_logits=True)
    total += float(tf.reduce_sum(loss))
    count += int(tf.size(loss))
  assert count == dataset.num_test_examples * 16
  assert results["loss"] == pytest.approx(total / count, rel=1e-5)


def test_the_export_takes_tokens(run):
  config, _ = run
  served = tf.saved_model.load(os.path.join(config.model_dir, "export"))
  tokens = tf.constant(np.arange(32, dtype=np.int32).reshape(2, 16))
  out = served.signatures["serving_default"](tokens=tokens)
  assert out["probabilities"].shape == (2, 16, 256)
  np.testing.assert_allclose(tf.reduce_sum(out["probabilities"], -1), 1.0,
                             rtol=1e-5)


def test_greedy_generation_takes_the_argmax_and_repeats(run):
  config, _ = run
  info, weights = prediction.resolve_model(config.model_dir)
  model = prediction.load_model(info, weights)
  prompt = list(b"def f(x):")
  out = prediction.generate(model, prompt, 5)
  assert out[:len(prompt)] == prompt and len(out) == len(prompt) + 5
  window = np.zeros([1, 16], np.int32)
  window[0, :len(prompt)] = prompt
  assert out[len(prompt)] == int(np.argmax(model(window)[0, len(prompt) - 1]))
  assert prediction.generate(model, prompt, 5) == out
  # Past the window: the context slides, and the output goes on.
  assert len(prediction.generate(model, prompt, 20)) == len(prompt) + 20
  sampled = [prediction.generate(model, prompt, 12, temperature=1.0, seed=s)
             for s in (1, 1, 2)]
  assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


@pytest.mark.slow
def test_predict_py_continues_a_prompt_from_another_folder(run, tmp_path):
  config, _ = run
  model_dir = os.path.relpath(config.model_dir, tmp_path)
  args = [f"--model_dir={model_dir}", "--prompt=import ",
          "--max_new_tokens=24"]
  greedy = [run_script("predict.py", *args, cwd=tmp_path).stdout
            for _ in range(2)]
  assert greedy[0] == greedy[1] and greedy[0].startswith("import ")
  sampled = run_script("predict.py", *args, "--temperature=0.9", "--seed=4",
                       f"--output_json={tmp_path / 'out.json'}",
                       cwd=tmp_path)
  written = json.load(open(tmp_path / "out.json"))
  assert written["text"] + "\n" == sampled.stdout
  assert written["seed"] == 4 and written["text"].startswith("import ")
  proc = run_script("predict.py", *args, "--index=0", check=False)
  assert_one_line_error(proc, "predict.py", "--prompt generates text")


@pytest.mark.slow
def test_evaluate_py_reports_the_runs_perplexity(run):
  config, results = run
  proc = run_script("evaluate.py", f"--model_dir={config.model_dir}",
                    "--eval_name=again")
  line = [l for l in proc.stdout.splitlines() if "perplexity" in l][0]
  assert float(line.split()[-1]) == pytest.approx(results["perplexity"],
                                                  rel=1e-5)
  assert "confusion matrix" not in proc.stdout


@pytest.mark.slow
def test_wrong_pairings_are_one_line(run, tmp_path):
  config, _ = run
  model_dir = tmp_path / "mlp_on_text"
  proc = run_script("train.py", "--model=mlp", "--dataset=text",
                    "--sequence_length=16", "--global_batch_size=4",
                    f"--data_dir={config.data_dir}", "--train_steps=1",
                    f"--model_dir={model_dir}", check=False)
  assert_one_line_error(proc, "train.py", "model='mlp' is a classification",
                        "language_model", "gpt")
  os.makedirs(tmp_path / "gpt_on_images")
  before = snapshot(str(tmp_path / "gpt_on_images"))
  proc = run_script("train.py", *GPT, "--dataset=synthetic",
                    "--train_steps=1",
                    f"--model_dir={tmp_path / 'gpt_on_images'}", check=False)
  assert_one_line_error(proc, "train.py", "model='gpt' is a language_model",
                        unchanged=before)
  proc = run_script("train.py", *GPT, "--num_heads=3", "--dataset=text",
                    "--global_batch_size=4",
                    f"--data_dir={config.data_dir}", "--train_steps=1",
                    f"--model_dir={tmp_path / 'heads'}", check=False)
  assert_one_line_error(proc, "train.py", "not divisible by num_heads=3")


@pytest.mark.slow
def test_train_py_from_another_folder_then_a_longer_relaunch_resumes(
    run, tmp_path):
  config, _ = run
  corpus = os.path.relpath(config.data_dir, tmp_path)
  args = [*GPT, "--dataset=text", f"--data_dir={corpus}",
          "--model_dir=lm", "--global_batch_size=4",
          "--export_saved_model=false"]
  run_script("train.py", *args, "--train_steps=2", cwd=tmp_path)
  proc = run_script("train.py", *args, "--train_steps=4", cwd=tmp_path)
  assert "Restored checkpoint " in proc.stderr and "ckpt-2" in proc.stderr
  steps = scalars(str(tmp_path / "lm" / "eval"), "perplexity")
  assert sorted(steps) == [2, 4]
