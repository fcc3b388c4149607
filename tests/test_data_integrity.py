"""Damaged TFRecord data and converter failures are one DataError line, never
a silent change: shard sizes are checked when a split opens, record counts
and fingerprints as shards stream, sidecar fields against their schema,
records against the sidecar; re-converted data is a new generation that a
resumed run notices; the converter fails in one line before converting."""

import json
import os
import resource
import signal
import subprocess
import sys

import numpy as np
from PIL import Image
import pytest
import tensorflow as tf

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from framework.data import file_input, image_folder, integrity, tfrecords
from framework.errors import DataError
from tests.helpers import ROOT, run_script
from tests.test_data_fuzz import _write, read_all


@pytest.fixture
def files(tmp_path):
  return _write(tmp_path / "set")


def _sidecar(path, split="train"):
  with open(os.path.join(path, f"{split}.json")) as f:
    return json.load(f)


def _save(path, sidecar, split="train"):
  with open(os.path.join(path, f"{split}.json"), "w") as f:
    json.dump(sidecar, f)


def _records(path):
  return [r.numpy() for r in tf.data.TFRecordDataset(path)]


def _rewrite(path, records):
  with tf.io.TFRecordWriter(path) as writer:
    for r in records:
      writer.write(r)


def _unverified(path, split="train"):
  """The sidecar as an older converter wrote it (no sizes, checksums)."""
  sidecar = _sidecar(path, split)
  for field in ("bytes_per_shard", "sha256_per_shard",
                "fingerprint_per_shard", "generation"):
    del sidecar[field]
  _save(path, sidecar, split)


def _error(path):
  got = read_all(path)
  assert isinstance(got, DataError), "read without an error"
  assert "\n" not in str(got)
  return str(got)


@pytest.mark.parametrize("cut", ["half", "mid_record", "empty", "extra"])
def test_a_shard_of_other_length_is_an_error_naming_it(files, cut):
  shard = os.path.join(files, _sidecar(files)["shards"][1])
  records = _records(shard)
  data = open(shard, "rb").read()
  if cut == "half":
    _rewrite(shard, records[:len(records) // 2])
  elif cut == "mid_record":
    open(shard, "wb").write(data[:len(data) // 2])
  elif cut == "empty":
    open(shard, "wb").close()
  else:
    _rewrite(shard, records + records[:2])
  # Sizes are checked when the split opens.
  assert f"shard {shard} is damaged" in _error(files)
  # Without sizes (an older sidecar) the streaming count still finds it.
  _unverified(files)
  message = _error(files)
  assert shard in message and ("ends after" in message or
                               "more than" in message)


def test_a_test_shard_cut_short_is_an_error_not_a_smaller_eval(files):
  _unverified(files, "test")
  shard = os.path.join(files, _sidecar(files, "test")["shards"][0])
  _rewrite(shard, _records(shard)[:-1])
  assert f"shard {shard} is damaged: it ends after 3 of the 4" in _error(
      files)


def test_same_size_other_records_are_an_error(files):
  sidecar = _sidecar(files)
  a, b = (os.path.join(files, n) for n in sidecar["shards"][:2])
  # A shard replaced by one of the same size (shards of equal counts of
  # same-shape noise images often are) passes the size check, not the
  # fingerprints.
  open(b, "wb").write(open(a, "rb").read())
  sidecar["bytes_per_shard"][1] = os.path.getsize(a)
  _save(files, sidecar)
  assert f"shard {b} holds other records" in _error(files)


def test_a_flipped_bit_is_one_line_naming_the_shard(files):
  shard = os.path.join(files, _sidecar(files)["shards"][2])
  data = bytearray(open(shard, "rb").read())
  data[len(data) // 2] ^= 8
  open(shard, "wb").write(data)
  assert f"shard {shard} is damaged" in _error(files)
  with pytest.raises(DataError, match="sha256 differs"):
    tfrecords.verify(files, "train")
  tfrecords.verify(files, "test")


@pytest.mark.parametrize("field,value,expected", [
    ("examples_per_shard", [-64, 8, 8 + 64], "'examples_per_shard' is [-64"),
    ("examples_per_shard", ["8", "8", "8"], "'examples_per_shard'"),
    ("image_shape", [4, 4], "'image_shape' is [4, 4]"),
    ("class_names", [], "'class_names' is []"),
    ("num_examples", "24", "'num_examples'"),
    (None, [1, 2], "the top level is a list"),
])
def test_a_bad_sidecar_field_is_one_line_naming_it(files, field, value,
                                                   expected):
  sidecar = _sidecar(files)
  if field is None:
    sidecar = value
  else:
    sidecar[field] = value
  _save(files, sidecar)
  assert expected in _error(files)


@pytest.mark.parametrize("field,value,expected", [
    ("image_shape", [4, 4, 1], "image_shape is [4, 4, 1] but example"),
    ("class_names", ["a", "b"], "class_names has 2 names but example"),
    ("label_shape", [4, 4], "has no image, index or mask"),
])
def test_a_sidecar_that_disagrees_with_the_records_is_an_error(
    files, field, value, expected):
  for split in ("train", "test"):
    sidecar = _sidecar(files, split)
    sidecar[field] = value
    _save(files, sidecar, split)
  assert expected in _error(files)


def test_an_old_sidecar_still_reads_exactly(files):
  intact = read_all(files)
  _unverified(files)
  _unverified(files, "test")
  assert read_all(files) == intact


def test_streaming_a_truncated_jpeg_names_the_file(tmp_path):
  rng = np.random.default_rng(0)
  for split in ("train", "test"):
    for name in ("cat", "dog"):
      os.makedirs(tmp_path / split / name)
      for i in range(2):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), np.uint8)).save(
            tmp_path / split / name / f"{i}.jpg", quality=90)
  bad = tmp_path / "test" / "dog" / "1.jpg"
  data = bad.read_bytes()
  bad.write_bytes(data[:len(data) - 40])  # the header stays intact
  dataset = image_folder.load_image_folder(str(tmp_path))
  with pytest.raises(tf.errors.OpError) as info:
    list(dataset.eval_dataset(4))
  error = integrity.data_error(info.value)
  assert error is not None and str(bad) in str(error), info.value


def _one_line(proc, script):
  lines = [l for l in proc.stderr.splitlines()
           if l.startswith(f"{script}: error: ")]
  assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  return lines[0]


TRAIN = ["--model=mlp", "--hidden_units=8", "--dataset=tfrecord",
         "--global_batch_size=8", "--steps_per_loop=2", "--eval_every=0",
         "--export_saved_model=false"]


@pytest.mark.slow
def test_train_py_on_a_flipped_bit_is_one_line_and_saves_nothing(files,
                                                                 tmp_path):
  shard = os.path.join(files, _sidecar(files)["shards"][0])
  data = bytearray(open(shard, "rb").read())
  data[40] ^= 1
  open(shard, "wb").write(data)
  model_dir = tmp_path / "run"
  proc = run_script("train.py", *TRAIN, f"--data_dir={files}",
                    "--train_steps=6", "--checkpoint_every=2",
                    f"--model_dir={model_dir}", check=False)
  assert shard in _one_line(proc, "train.py")
  assert not (model_dir / "checkpoint").exists()


@pytest.mark.slow
def test_resuming_on_reconverted_data_is_one_line(files, tmp_path):
  model_dir = tmp_path / "run"
  common = [*TRAIN, f"--data_dir={files}", "--checkpoint_every=2",
            f"--model_dir={model_dir}"]
  run_script("train.py", *common, "--train_steps=2")
  generation = json.load(open(model_dir / "run_config.json"))[
      "data_generation"]
  # Re-converted in place with other content: another generation.
  data = framework.data.datasets.synthetic(num_train=24, num_test=8, image_shape=(4, 4, 3),
                             num_classes=3, seed=6)
  tfrecords.write_split(files, "train", lambda i: (data.train_x[i],
                                                   data.train_y[i]),
                        24, num_shards=3, class_names=data.class_names)
  line = _one_line(run_script("train.py", *common, "--train_steps=4",
                              check=False), "train.py")
  assert "data_generation" in line and generation in line
  run_script("train.py", *common, "--train_steps=4", "--allow_config_change")
  assert json.load(open(model_dir / "run_config.json"))[
      "data_generation"] != generation


def _convert(src, out, **kwargs):
  return run_script("make_tfrecords.py", "--dataset=cifar10",
                    f"--data_dir={src}", f"--output_dir={out}",
                    "--num_shards=2", check=False, **kwargs)


@pytest.fixture
def cifar(tmp_path):
  rng = np.random.default_rng(3)
  framework.data.datasets.write_cifar10(
      str(tmp_path / "src"), rng.integers(0, 256, (6, 32, 32, 3), np.uint8),
      rng.integers(0, 10, 6), rng.integers(0, 256, (2, 32, 32, 3), np.uint8),
      rng.integers(0, 10, 2))
  return tmp_path / "src"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["file", "under_file"])
def test_converter_output_dir_a_file_is_one_line_before_converting(
    cifar, tmp_path, where):
  (tmp_path / "f").write_text("x")
  out = tmp_path / "f" if where == "file" else tmp_path / "f" / "out"
  proc = _convert(cifar, out)
  line = _one_line(proc, "make_tfrecords.py")
  assert "output_dir=" in line and "file" in line
  assert "writing train" not in proc.stderr  # before converting
  assert (tmp_path / "f").read_text() == "x"


@pytest.mark.slow
def test_converter_on_a_full_disk_is_one_line_and_keeps_the_old_set(
    cifar, tmp_path):
  out = tmp_path / "out"
  assert _convert(cifar, out).returncode == 0
  before = read_all(str(out))

  def small_files():
    # Writes past 2 KiB fail (EFBIG), as on a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "make_tfrecords.py"),
       "--dataset=cifar10", f"--data_dir={cifar}", f"--output_dir={out}",
       "--num_shards=2", "--seed=1"], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=300, preexec_fn=small_files)
  line = _one_line(proc, "make_tfrecords.py")
  assert f"cannot write {out}" in line and "unchanged" in line
  assert read_all(str(out)) == before
  assert not [n for n in os.listdir(out) if n.startswith(".")]


@pytest.mark.slow
def test_verify_checks_every_shard(cifar, tmp_path):
  out = tmp_path / "out"
  _convert(cifar, out)
  proc = run_script("make_tfrecords.py", f"--verify={out}")
  assert "every shard matches" in proc.stdout
  folder = out / json.load(open(out / "dataset.json"))["folder"]
  shard = folder / "test-00001-of-00002.tfrecord"
  data = bytearray(shard.read_bytes())
  data[-3] ^= 2
  shard.write_bytes(data)
  line = _one_line(run_script("make_tfrecords.py", f"--verify={out}",
                              check=False), "make_tfrecords.py")
  assert str(shard) in line and "sha256" in line


def test_the_generation_is_a_digest_of_the_content(tmp_path):
  a, b = _write(tmp_path / "a"), _write(tmp_path / "b")
  assert _sidecar(a)["generation"] == _sidecar(b)["generation"]
  data = framework.data.datasets.synthetic(num_train=24, num_test=8, image_shape=(4, 4, 3),
                             num_classes=3, seed=6)
  tfrecords.write_split(b, "train", lambda i: (data.train_x[i],
                                               data.train_y[i]),
                        24, num_shards=3, class_names=data.class_names)
  assert _sidecar(a)["generation"] != _sidecar(b)["generation"]
  assert (file_input.load_tfrecord(a).generation !=
          file_input.load_tfrecord(b).generation)
