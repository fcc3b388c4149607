"""--malloc=tcmalloc: the run starts again with tcmalloc, before TF loads."""

import re

import pytest

from framework.errors import ConfigError
from framework.perf import allocator
from tests.helpers import run_script

ARGS = ("--model=cifar_cnn", "--dataset=synthetic", "--nodropout",
        "--global_batch_size=16", "--train_steps=3", "--steps_per_loop=3",
        "--eval_every=0", "--checkpoint_every=0", "--noexport_saved_model",
        "--seed=5")

needs_tcmalloc = pytest.mark.skipif(
    allocator.find_tcmalloc() is None,
    reason="no tcmalloc here (apt-get install libtcmalloc-minimal4)")


def _run(tmp_path, *args, env=None, check=True):
  return run_script("train.py", *ARGS, *args, env=env, check=check,
                    fresh=True)


@needs_tcmalloc
def test_tcmalloc_run_uses_it_and_trains_the_same_weights(tmp_path):
  runs = {}
  for choice in ("default", "tcmalloc"):
    # Without the suite's own preload (tests/conftest.py): --malloc=default
    # is then glibc's malloc, and tcmalloc comes from the re-exec alone.
    proc = _run(tmp_path, f"--malloc={choice}",
                f"--model_dir={tmp_path / choice}", env={"LD_PRELOAD": None})
    log = proc.stdout + proc.stderr
    [state] = re.findall(r"memory allocator: (\w+) \(--malloc=(\w+)\)", log)
    [weights] = re.findall(r"final weights sha256=(\w+)", log)
    runs[choice] = state, weights
  assert runs["default"][0] == ("default", "default")
  assert runs["tcmalloc"][0] == ("tcmalloc", "tcmalloc")
  # Where memory comes from does not change a single bit of training.
  assert runs["tcmalloc"][1] == runs["default"][1]


def test_a_preload_that_does_not_take_is_one_line_not_a_loop(tmp_path):
  # As if the re-executed process still lacked tcmalloc (a library that
  # the loader could not preload): an error, not another exec.
  proc = _run(tmp_path, "--malloc=tcmalloc",
              f"--model_dir={tmp_path / 'run'}",
              env={"DISTLOOP_MALLOC_REEXEC": "1", "LD_PRELOAD": None},
              check=False)
  assert proc.returncode == 1, proc.stderr[-2000:]
  [line] = [l for l in proc.stderr.splitlines() if "error" in l]
  assert line.startswith("train.py: error: malloc='tcmalloc': "), line
  assert not (tmp_path / "run").exists()


def test_preload_env_puts_tcmalloc_first_and_keeps_other_preloads(
    monkeypatch):
  monkeypatch.setattr(allocator, "find_tcmalloc",
                      lambda: "libtcmalloc_minimal.so.4")
  env = allocator.preload_env("tcmalloc", {"LD_PRELOAD": "libfoo.so", "A": "1"})
  assert env == {"LD_PRELOAD": "libtcmalloc_minimal.so.4:libfoo.so", "A": "1"}
  # Twice is the same as once.
  assert allocator.preload_env("tcmalloc", env) == env
  assert allocator.preload_env("default", {"A": "1"}) == {"A": "1"}


def test_missing_tcmalloc_and_unknown_names_are_config_errors(monkeypatch):
  monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)
  assert allocator.find_tcmalloc() is None
  with pytest.raises(ConfigError, match=r"malloc='tcmalloc': no tcmalloc "
                     r"library .*apt-get install libtcmalloc-minimal4"):
    allocator.preload_env("tcmalloc", {})
  with pytest.raises(ConfigError, match=r"malloc='jemalloc' is not one of "
                     r"default, tcmalloc"):
    allocator.preload_env("jemalloc", {})
