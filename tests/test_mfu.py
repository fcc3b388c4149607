"""FLOP/s, tokens/s and MFU in the log line, TensorBoard and metrics.jsonl:
the GPT's FLOPs are nanoGPT's closed form, a CNN's its layers' count, the
MFU divides by the host's peak in the run's compute dtype (kept in the
cache folder), and a damaged cache is measured again."""

import json
import os

import keras
import pytest

import framework
from framework.app import experiment
from framework.perf import flops, peak, throughput
from models import registry
from tests.helpers import run_script
from tests.test_controller import scalars
from tests.test_text_dataset import write_corpus

# Peaks no machine measures, so that the MFU shows which entry it used.
PEAKS = {"float32": 3.0e11, "bfloat16": 7.0e11}


def write_peaks(folder):
  """A cache folder whose peak file holds `PEAKS` for this host."""
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, peak.CACHE_FILE), "w") as f:
    json.dump({peak.key(dtype): value for dtype, value in PEAKS.items()}, f)
  return str(folder)


def points(model_dir):
  """{name: {step: value}} of model_dir/metrics.jsonl's train points."""
  found = {}
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    for line in f:
      point = json.loads(line)
      if point["split"] == "train":
        found.setdefault(point["name"], {})[point["step"]] = point["value"]
  return found


def test_gpt_flops_per_sequence_are_nanogpts_closed_form():
  length, width, layers, vocab = 16, 8, 2, 256
  for tied in (True, False):
    model = registry.build_model(
        "gpt", (length,), vocab, num_layers=layers, num_heads=2,
        model_width=width, tie_embeddings=tied)
    block = (4 * width                          # two layer norms
             + 4 * (width * width + width)      # query, key, value, out
             + (width * 4 * width + 4 * width)  # mlp fc
             + (4 * width * width + width))     # mlp proj
    # The table of a tied head is its matmul; an untied table is a lookup
    # and the head's own kernel the matmul. No position table.
    params = layers * block + 2 * width + vocab * width
    per_token = 6 * params + 12 * layers * width * length
    assert registry.flops_counter("gpt")(model) == length * per_token


def test_cnn_flops_per_example_are_its_layers_by_hand():
  model = keras.Sequential([
      keras.Input((8, 8, 3)),
      keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
      keras.layers.Flatten(),
      keras.layers.Dense(5)])
  conv = 8 * 8 * 4 * 3 * 3 * 3  # multiply-adds of the forward pass
  dense = 8 * 8 * 4 * 5
  # Forward and weight gradient of both; an input gradient for the Dense
  # only (nothing trainable precedes the conv).
  by_hand = 2 * conv * 2 + 2 * dense * 3
  assert flops.model_flops_per_example(model, (8, 8, 3)) == by_hand
  assert registry.flops_counter("cifar_cnn") is None  # counted, not closed


def test_unet_flops_per_example_are_its_layers_by_hand():
  model = registry.build_model("unet", (4, 4, 3), 3, depth=1, width=2)
  pixels = 4 * 4
  # Multiply-adds of each forward pass: 3x3 convs at full and half
  # resolution, the 2x2 stride-2 transposed conv (4 -> 2 channels), the
  # decoder's convs over the concatenation (4 channels), the 1x1 head.
  first = pixels * 2 * 9 * 3
  others = (pixels * 2 * 9 * 2 + 4 * 4 * 9 * 2 + 4 * 4 * 9 * 4
            + pixels * 2 * 4 + pixels * 2 * 9 * 4 + pixels * 2 * 9 * 2
            + pixels * 3 * 2)
  by_hand = 2 * (2 * first + 3 * others)  # no input gradient of the first
  assert flops.model_flops_per_example(model, (4, 4, 3)) == by_hand


def train_gpt(tmp_path, *flags):
  """A 4-step gpt run with the `PEAKS` cache; (model_dir, stderr)."""
  write_corpus(str(tmp_path / "corpus"), num_files=20)
  cache = write_peaks(tmp_path / "cache")
  model_dir = str(tmp_path / "run")
  proc = run_script(
      "train.py", "--model=gpt", "--num_layers=1", "--num_heads=2",
      "--model_width=16", "--sequence_length=16", "--dataset=text",
      f"--data_dir={tmp_path / 'corpus'}", f"--model_dir={model_dir}",
      "--global_batch_size=8", "--train_steps=4", "--steps_per_loop=2",
      "--log_every=2", "--summary_every=2", "--mixed_precision=float32",
      "--export_saved_model=false", *flags,
      env={"DISTLOOP_CACHE_DIR": cache}, timeout=900)
  return model_dir, proc.stderr


def check_gpt_points(model_dir):
  """perf/* of a train_gpt run: the closed form's FLOPs, the float32 peak."""
  found = points(model_dir)
  model = registry.build_model("gpt", (16,), 256, num_layers=1, num_heads=2,
                               model_width=16)
  per_example = registry.flops_counter("gpt")(model)
  for step in (2, 4):
    examples = found["examples_per_second"][step]
    assert found["perf/flops_per_sec"][step] == pytest.approx(
        per_example * examples, rel=1e-9)
    assert found["perf/mfu"][step] == pytest.approx(
        found["perf/flops_per_sec"][step] / PEAKS["float32"], rel=1e-9)
    assert found["perf/tokens_per_sec"][step] == pytest.approx(
        16 * examples, rel=1e-9)


def test_each_gpu_counts_once_and_a_cpu_once_per_process():
  assert throughput.peak_devices(
      ["/job:worker/replica:0/task:0/device:GPU:0", "/GPU:0", "/gpu:1"],
      processes=2) == ("GPU", 4)
  assert throughput.peak_devices(["/CPU:0", "/CPU:1", "/CPU:2"]) == ("CPU",
                                                                    1)
  assert throughput.peak_devices((), processes=3) == ("CPU", 3)


@pytest.mark.slow
def test_split_gpt_counts_the_whole_model_against_one_cpu_peak(tmp_path):
  # Its 2 logical CPU devices share one CPU: one peak, not two.
  model_dir, _ = train_gpt(tmp_path, "--mesh=model:2", "--cpu_devices=2")
  check_gpt_points(model_dir)


def test_gpt_run_logs_tokens_per_second_and_mfu_of_its_float32_peak(
    tmp_path):
  model_dir, stderr = train_gpt(tmp_path)
  lines = [line for line in stderr.splitlines() if "train step 4/4" in line]
  assert len(lines) == 1 and " tokens/s=" in lines[0] and " MFU=" in lines[0]
  check_gpt_points(model_dir)
  events = os.path.join(model_dir, "train")
  for tag in ("perf/mfu", "perf/flops_per_sec", "perf/tokens_per_sec"):
    assert sorted(scalars(events, tag)) == [2, 4]
  # The peak stays in the cache folder, never in the run's.
  assert not any("peak" in name for _, _, names in os.walk(model_dir)
                 for name in names)


def test_bfloat16_cnn_run_divides_by_the_bfloat16_peak(tmp_path,
                                                       monkeypatch):
  monkeypatch.setenv("DISTLOOP_CACHE_DIR",
                     write_peaks(tmp_path / "cache"))
  config = framework.ExperimentConfig(
      model="cifar_cnn", dataset="synthetic", model_dir=str(tmp_path / "run"),
      global_batch_size=8, train_steps=2, mixed_precision="bfloat16",
      export_saved_model=False,
      loop=framework.LoopConfig(train_steps=2, steps_per_loop=1,
                                summary_every=1, log_every=1))
  experiment.run(config)
  found = points(config.model_dir)
  assert "perf/tokens_per_sec" not in found  # images: no tokens
  per_example = flops.model_flops_per_example(
      registry.build_model("cifar_cnn", (32, 32, 3), 10), (32, 32, 3))
  for step in (1, 2):
    assert found["perf/flops_per_sec"][step] == pytest.approx(
        per_example * found["examples_per_second"][step], rel=1e-9)
    assert found["perf/mfu"][step] == pytest.approx(
        found["perf/flops_per_sec"][step] / PEAKS["bfloat16"], rel=1e-9)
  assert sorted(scalars(os.path.join(config.model_dir, "train"),
                        "perf/mfu")) == [1, 2]


# Figures no device has (1e308 FLOP/s would give every run an MFU of 0).
_FIGURES = {"NEGATIVE": -5.0, "HUGE": 1e308, "TINY": 1e-300}


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", "", *_FIGURES])
def test_a_damaged_cache_is_measured_again_and_rewritten(tmp_path,
                                                         monkeypatch,
                                                         damage):
  monkeypatch.setenv("DISTLOOP_CACHE_DIR", str(tmp_path))
  path = peak.cache_path()
  with open(path, "w") as f:
    f.write(json.dumps({peak.key("float32"): _FIGURES[damage]})
            if damage in _FIGURES else damage)
  measured = []

  def measure(dtype, device):
    measured.append((dtype, device))
    return 2.0e11

  assert peak.peak_flops("float32", measure=measure) == 2.0e11
  assert measured == [("float32", "/CPU:0")]
  assert json.load(open(path)) == {peak.key("float32"): 2.0e11}
  # Kept: the next run reads it; another dtype is measured on its own.
  assert peak.peak_flops("float32", measure=measure) == 2.0e11
  assert peak.peak_flops("bfloat16", measure=measure) == 2.0e11
  assert measured == [("float32", "/CPU:0"), ("bfloat16", "/CPU:0")]
  assert set(json.load(open(path))) == {peak.key("float32"),
                                        peak.key("bfloat16")}


@pytest.mark.parametrize("blocker", ["file_is_a_folder", "cache_is_a_file"])
def test_a_peak_that_cannot_be_kept_is_not_logged_as_kept(tmp_path,
                                                          monkeypatch,
                                                          blocker):
  cache = tmp_path / "cache"
  if blocker == "file_is_a_folder":
    (cache / peak.CACHE_FILE).mkdir(parents=True)
  else:
    cache.write_text("")
  monkeypatch.setenv("DISTLOOP_CACHE_DIR", str(cache))
  logged = []
  monkeypatch.setattr(peak.logging, "info",
                      lambda fmt, *args: logged.append(fmt % args))
  assert peak.peak_flops("float32", measure=lambda *_: 2.0e11) == 2.0e11
  assert len(logged) == 1 and "not kept" in logged[0], logged
  assert "kept in" not in logged[0]


@pytest.mark.parametrize("stand_in", ["/dev/zero", "huge"])
def test_a_cache_file_that_never_ends_is_measured_again(tmp_path, monkeypatch,
                                                        stand_in):
  monkeypatch.setenv("DISTLOOP_CACHE_DIR", str(tmp_path))
  path = peak.cache_path()
  if stand_in == "huge":  # valid JSON, larger than any cache holds
    with open(path, "w") as f:
      json.dump({peak.key("float32"): 3.0e11, "padding": "x" * (2 << 20)}, f)
  else:
    os.symlink(stand_in, path)
  assert peak.peak_flops("float32", measure=lambda *_: 2.0e11) == 2.0e11
