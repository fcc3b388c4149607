"""A garbled `checkpoint` state file beside intact checkpoints.

TensorFlow reads an unparsable state file as no state at all (a ParseError
warning, then None). distloop names the file as unreadable, finds the
checkpoints from their own files, resumes from the newest intact one and
rewrites the state file atomically; evaluate.py evaluates that newest one
without writing anything into the run.
"""

import os
import shutil

import pytest

from helpers import run_script, snapshot

RUN = ["--model=mlp", "--hidden_units=16", "--dataset=synthetic",
       "--global_batch_size=32", "--checkpoint_every=10",
       "--steps_per_loop=10", "--export_saved_model=false"]
GARBAGE = "garbage !!! {{\n"


def _train(cwd, *args, **kwargs):
  return run_script("train.py", *RUN, "--model_dir=runs/d3", *args,
                    cwd=cwd, **kwargs)


def _state(run_dir):
  with open(run_dir / "checkpoint") as f:
    return f.read()


@pytest.fixture(scope="module")
def twenty_steps(tmp_path_factory):
  """A run with intact ckpt-10 and ckpt-20 (relative --model_dir)."""
  cwd = tmp_path_factory.mktemp("garbled")
  _train(cwd, "--train_steps=20")
  run_dir = cwd / "runs" / "d3"
  assert {"ckpt-10.index", "ckpt-20.index"} <= set(os.listdir(run_dir))
  return run_dir


def _garbled_copy(run_dir, tmp_path, text=GARBAGE):
  cwd = tmp_path / "work"
  shutil.copytree(run_dir, cwd / "runs" / "d3")
  (cwd / "runs" / "d3" / "checkpoint").write_text(text)
  return cwd


@pytest.mark.slow
@pytest.mark.parametrize("text", [GARBAGE, ""], ids=["garbage", "empty"])
def test_train_names_the_state_file_resumes_and_rewrites_it(
    twenty_steps, tmp_path, text):
  cwd = _garbled_copy(twenty_steps, tmp_path, text)
  run_dir = cwd / "runs" / "d3"
  proc = _train(cwd, "--train_steps=30")
  state_file = str(run_dir / "checkpoint")
  warning = [l for l in proc.stderr.splitlines()
             if state_file in l and "unreadable" in l]
  assert len(warning) == 1, proc.stderr[-3000:]
  assert "ckpt-10, ckpt-20" in warning[0], warning[0]
  assert "missing or empty" not in proc.stderr
  assert "ParseError" not in proc.stderr.replace(warning[0], "")
  assert f"Restored checkpoint {run_dir}/ckpt-20" in proc.stderr
  # The state file is TensorFlow's again: every checkpoint listed, in order.
  state = _state(run_dir)
  assert 'model_checkpoint_path: "ckpt-30"' in state, state
  assert [l.split('"')[1] for l in state.splitlines()
          if l.startswith("all_model_checkpoint_paths")] == [
              "ckpt-10", "ckpt-20", "ckpt-30"], state
  # The next run reads it cleanly: no warning, resumes from ckpt-30, and
  # rotation (keep 3) removes the oldest, not the rebuilt entries' files.
  again = _train(cwd, "--train_steps=40")
  assert "unreadable" not in again.stderr
  assert f"Restored checkpoint {run_dir}/ckpt-30" in again.stderr
  names = set(os.listdir(run_dir))
  assert "ckpt-10.index" not in names, names
  assert {"ckpt-20.index", "ckpt-30.index", "ckpt-40.index"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("watch", [[], ["--watch", "--timeout_seconds=5"]],
                         ids=["latest", "watch"])
def test_evaluate_uses_the_newest_intact_checkpoint_and_writes_no_state(
    twenty_steps, tmp_path, watch):
  cwd = _garbled_copy(twenty_steps, tmp_path)
  run_dir = cwd / "runs" / "d3"
  before = snapshot(run_dir)
  proc = run_script("evaluate.py", "--model_dir=runs/d3", *watch, cwd=cwd)
  # (--watch names the folder as given: relative.)
  assert "runs/d3/ckpt-20 (step 20)" in proc.stdout, (
      proc.stdout + proc.stderr[-3000:])
  assert "has no checkpoint" not in proc.stderr
  assert "runs/d3/checkpoint is unreadable" in proc.stderr, proc.stderr[-3000:]
  assert _state(run_dir) == GARBAGE  # a reader does not repair the run
  kept = lambda tree: {p: d for p, d in tree.items()
                       if not p.startswith("eval_")}
  assert kept(snapshot(run_dir).tree) == kept(before.tree)


@pytest.mark.slow
def test_a_garbled_state_file_and_a_damaged_newest_checkpoint(
    twenty_steps, tmp_path):
  cwd = _garbled_copy(twenty_steps, tmp_path)
  run_dir = cwd / "runs" / "d3"
  (run_dir / "ckpt-20.index").unlink()
  proc = _train(cwd, "--train_steps=30")
  assert f"Restored checkpoint {run_dir}/ckpt-10" in proc.stderr
  assert "ckpt-20.index is missing" in proc.stderr
  # Resumed at step 10, so ckpt-20 is written again, intact this time.
  assert "ckpt-20.index" in os.listdir(run_dir)
  assert 'model_checkpoint_path: "ckpt-30"' in _state(run_dir)


@pytest.mark.parametrize("content, why", [
    (b"garbage !!! {{\n", "does not parse"),
    (b"", "is empty"),
    (b"\xff\xfe\x00binary", "not text"),
    (b'all_model_checkpoint_paths: "ckpt-10"\n', "names no checkpoint"),
])
def test_unreadable_state_files_are_rebuilt_from_the_files(tmp_path, content,
                                                           why):
  from framework.core.checkpoints import manager  # pylint: disable=g-import-not-at-top
  for name in ("ckpt-10.index", "ckpt-10.data-00000-of-00001",
               "ckpt-9.index", "ckpt-100.data-00000-of-00001", "ckpt-7x.index",
               "notes.txt"):
    (tmp_path / name).write_text("x")
  (tmp_path / "checkpoint").write_bytes(content)
  assert why in manager.problem(str(tmp_path))
  found = [os.path.basename(p) for p in manager.recovered(
      str(tmp_path))]
  assert found == ["ckpt-9", "ckpt-10", "ckpt-100"]  # by number, not name
  assert manager.latest(str(tmp_path)).endswith("ckpt-100")
  assert manager.rebuild(str(tmp_path)) is not None
  assert manager.problem(str(tmp_path)) is None
  state = _state(tmp_path)
  assert 'model_checkpoint_path: "ckpt-100"' in state, state
  assert state.count("all_model_checkpoint_timestamps") == 3, state
  assert manager.rebuild(str(tmp_path)) is None  # nothing to do


def test_a_readable_or_absent_state_file_is_left_to_tensorflow(tmp_path):
  from framework.core.checkpoints import manager  # pylint: disable=g-import-not-at-top
  assert manager.problem(str(tmp_path)) is None
  assert manager.recovered(str(tmp_path)) is None
  (tmp_path / "checkpoint").write_text(GARBAGE)
  assert manager.rebuild(str(tmp_path)) is not None
  assert not (tmp_path / "checkpoint").exists()  # no checkpoints: removed
