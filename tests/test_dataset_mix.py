"""--dataset=mix: examples drawn from several datasets in the weights'
proportions, batches a function of (seed, step) (a relaunch trains the
same weights), sharded per input pipeline, bad mixes one line."""

import os

import numpy as np
import pytest
import tensorflow as tf

import framework
from framework.app import experiment
from framework.data import datasets, mixture
from framework.data.config import DatasetOptions
from framework.errors import ConfigError
from tests import helpers
from tests.helpers import assert_one_line_error, run_script, snapshot
from tests.test_train_script import weights

LENGTH = 8
# Source a's bytes are lowercase letters, b's uppercase: an example's first
# token names its source.
ALPHABETS = {"a": (97, 123), "b": (65, 91)}


def write_corpora(root, num_files=10):
  """Corpora a/ and b/ of `num_files` files each; returns their folders."""
  rng = np.random.default_rng(0)
  folders = {}
  for name, (low, high) in ALPHABETS.items():
    folder = os.path.join(root, name)
    os.makedirs(folder, exist_ok=True)
    for i in range(num_files):
      with open(os.path.join(folder, f"doc_{i:02d}.txt"), "wb") as f:
        f.write(bytes(rng.integers(low, high, size=int(rng.integers(
            8 * LENGTH, 20 * LENGTH))).astype(np.uint8)))
    folders[name] = folder
  return folders


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
  return write_corpora(str(tmp_path_factory.mktemp("corpora")))


def options(corpora, mix=("a=text:0.7", "b=text:0.3")):
  return DatasetOptions(
      sequence_length=LENGTH, mix=mix,
      mix_data_dirs=tuple(f"{k}:{v}" for k, v in corpora.items()
                          if any(m.startswith(f"{k}=") for m in mix))
  ).for_dataset("mix")


def load(corpora, seed=5, **kwargs):
  return datasets.load_dataset("mix", seed=seed, **options(corpora, **kwargs))


def from_a(tokens):
  return tokens[..., 0] >= ALPHABETS["a"][0]


def test_proportions_follow_the_weights_and_are_logged_exactly(corpora):
  mix = load(corpora)
  batch, steps = 8, 600  # 4800 examples: past the first choice block
  drawn = np.concatenate([from_a(x.numpy()) for x, _ in
                          mix.train_dataset(batch, seed=5).take(steps)])
  assert drawn.mean() == pytest.approx(0.7, abs=0.01)
  counts = mix.log_counts(steps, batch)
  assert counts.tolist() == [drawn.sum(), (~drawn).sum()]
  # Every block of mixture.BLOCK examples holds the quotas exactly.
  assert drawn[:mixture.BLOCK].sum() == mixture.quotas([0.7, 0.3])[0]


def test_any_start_step_continues_the_stream_exactly(corpora):
  mix = load(corpora)
  batch = 8
  whole = [x.numpy() for x, _ in mix.train_dataset(batch, seed=5).take(530)]
  # 513 * 8 = 4104: past a block boundary, into the sources' later epochs.
  for start in (1, 7, 511, 513):
    resumed = [x.numpy() for x, _ in
               mix.train_dataset(batch, seed=5, start_step=start).take(12)]
    for expected, got in zip(whole[start:], resumed):
      np.testing.assert_array_equal(expected, got)


def test_pipelines_read_their_own_shards_of_each_source(corpora):
  mix = load(corpora)
  seen = []
  for pipeline in range(2):
    context = tf.distribute.InputContext(num_input_pipelines=2,
                                         input_pipeline_id=pipeline,
                                         num_replicas_in_sync=2)
    ds = mix.train_dataset_fn(8, seed=5)(context)
    seen.append({bytes(row.astype(np.uint8)) for x, _ in ds.take(40)
                 for row in x.numpy()})
  # File sharding: no window is read by both pipelines.
  assert seen[0] and seen[1] and not seen[0] & seen[1]


def test_the_eval_split_is_every_sources_test_split(corpora):
  mix = load(corpora)
  rows = sum(int(b.mask.numpy().sum()) for b in mix.eval_dataset(8))
  assert rows == mix.num_test_examples > 0
  assert mix.num_test_examples == sum(
      datasets.load_dataset("text", corpora[k], sequence_length=LENGTH)
      .num_test_examples for k in ALPHABETS)


@pytest.mark.parametrize("weight", ["0", "-1", "nan", "inf", "x", ""])
def test_a_bad_weight_is_a_config_error_naming_it(weight):
  with pytest.raises(ConfigError, match=r"mix='a=text:.*positive number"):
    DatasetOptions(mix=("b=text:1", f"a=text:{weight}"))


def test_unknown_sources_and_other_shapes_are_config_errors(corpora):
  with pytest.raises(ConfigError, match="mix source c=nosuch: .*unknown"):
    load(corpora, mix=("a=text:1", "c=nosuch:1"))
  with pytest.raises(ConfigError, match="mix_data_dirs='z:/x'.*no source"):
    DatasetOptions(mix=("text:1",), mix_data_dirs=("z:/x",))
  with pytest.raises(ConfigError, match="mix_data_dirs='a:/y'.*twice"):
    DatasetOptions(mix=("a=text:1",), mix_data_dirs=("a:/x", "a:/y"))
  with pytest.raises(ConfigError, match="source synthetic .*same shapes"):
    load(corpora, mix=("a=text:1", "synthetic:1"))


def test_uint8_and_float_sources_are_a_config_error(tmp_path):
  # uint8 is divided by 255, float32 reaches the model as it is: both are
  # float32 examples, but on different scales.
  for name, dtype in (("u8", np.uint8), ("f32", np.float32)):
    np.savez(tmp_path / f"{name}.npz", x_train=np.ones((4, 3), dtype),
             y_train=np.arange(4) % 2, x_test=np.ones((2, 3), dtype),
             y_test=np.arange(2) % 2)
  dirs = (f"u8:{tmp_path / 'u8.npz'}", f"f32:{tmp_path / 'f32.npz'}")
  with pytest.raises(ConfigError, match="source f32 has float32 features, "
                     "u8 uint8; uint8 images are divided by 255"):
    mixture.load_mix(mix=("u8=numpy:1", "f32=numpy:1"), mix_data_dirs=dirs)
  mixture.load_mix(mix=("u8=numpy:1", "again=numpy:1"),  # one dtype: fine
                   mix_data_dirs=(dirs[0], f"again:{tmp_path / 'u8.npz'}"))


def test_a_resume_with_other_weights_is_a_config_change(tmp_path):
  # The resumed streams would start where the new weights put them, not
  # where the run stopped.
  data = str(tmp_path / "x.npz")
  np.savez(data, x_train=np.ones((8, 3), np.float32),
           y_train=np.arange(8) % 2, x_test=np.ones((2, 3), np.float32),
           y_test=np.arange(2) % 2)

  def config(steps, weight_b):
    return helpers.tiny_mlp_config(
        tmp_path / "run", dataset="mix", global_batch_size=4,
        train_steps=steps, dataset_options=dict(
            mix=("a=numpy:1", f"b=numpy:{weight_b}"),
            mix_data_dirs=(f"a:{data}", f"b:{data}")))

  experiment.run(config(2, 1))
  with pytest.raises(framework.CheckpointError,
                     match=r'mix was \{"a": "numpy:2048/4096", "b": '
                     r'"numpy:2048/4096"\}, now \{"a": "numpy:2731/4096"'):
    experiment.run(config(4, 0.5))
  experiment.run(config(4, 2.0 / 2))  # the same shares: resumes


def _config(corpora, model_dir, steps):
  return framework.ExperimentConfig(
      model="gpt", dataset="mix", model_dir=str(model_dir),
      strategy="mirrored", global_batch_size=8, train_steps=steps, seed=5,
      model_options=dict(num_layers=1, num_heads=2, model_width=16),
      dataset_options=options(corpora), export_saved_model=False,
      loop=framework.LoopConfig(train_steps=steps, steps_per_loop=2,
                                checkpoint_every=3, eval_every=6))


@pytest.mark.slow
def test_a_relaunch_trains_the_weights_of_an_uninterrupted_run(corpora,
                                                              tmp_path):
  experiment.run(_config(corpora, tmp_path / "straight", 6))
  # Stopped at step 3 (as a kill -9 after that checkpoint), relaunched.
  experiment.run(_config(corpora, tmp_path / "resumed", 3))
  experiment.run(_config(corpora, tmp_path / "resumed", 6))
  expected, resumed = (weights(str(tmp_path / "straight")),
                       weights(str(tmp_path / "resumed")))
  assert expected.keys() == resumed.keys() and expected
  for name in expected:
    np.testing.assert_array_equal(expected[name], resumed[name])


def test_train_py_bad_mixes_are_one_line_and_touch_nothing(corpora,
                                                           tmp_path):
  model_dir = tmp_path / "run"
  os.makedirs(model_dir)
  before = snapshot(str(model_dir))
  common = ["--model=gpt", "--dataset=mix", f"--model_dir={model_dir}",
            f"--sequence_length={LENGTH}", "--train_steps=2",
            f"--mix_data_dirs=a:{corpora['a']}"]
  proc = run_script("train.py", *common, "--mix=a=text:0,b=text:1",
                    check=False)
  assert_one_line_error(proc, "train.py", "mix='a=text:0'", "positive",
                        unchanged=before)
  proc = run_script("train.py", *common, "--mix=a=text:1,synthetic:1",
                    check=False)
  assert_one_line_error(proc, "train.py", "synthetic", "same shapes",
                        unchanged=before)
