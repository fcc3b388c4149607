"""A run record replaced by a FIFO, a device or a dangling symlink is one
CheckpointError naming it, never a run that blocks forever on open or one
that takes the record for absent; spike_batches.json is held to the size
limit of the other records."""

import os
import threading

import pytest

from framework.core import spikes
from framework.core.checkpoints import run_files
from framework.errors import CheckpointError


def _read_within(read, path, seconds=20):
  """What `read()` raised, failing the test if it blocks."""
  outcome = {}

  def target():
    try:
      read()
    except Exception as e:  # pylint: disable=broad-except
      outcome["error"] = e

  thread = threading.Thread(target=target, daemon=True)
  thread.start()
  thread.join(seconds)
  if thread.is_alive():
    # Open the writing end so that the blocked reader returns.
    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    thread.join(seconds)
    pytest.fail(f"reading {path} blocked")
  return outcome.get("error")


@pytest.mark.parametrize("name", ["run_config.json", spikes.BATCHES_FILE])
def test_a_fifo_in_place_of_a_record_is_one_line(tmp_path, name):
  path = tmp_path / name
  os.mkfifo(path)
  if name == spikes.BATCHES_FILE:
    read = lambda: spikes.RollbackRecord(str(tmp_path))
  else:
    read = lambda: run_files.read_json(str(path), "; delete it")
  error = _read_within(read, str(path))
  assert isinstance(error, CheckpointError), error
  assert str(path) in str(error) and "not a regular file" in str(error)
  assert "\n" not in str(error)


def test_a_dangling_symlink_is_not_taken_for_no_record(tmp_path):
  (tmp_path / spikes.BATCHES_FILE).symlink_to(tmp_path / "gone.json")
  with pytest.raises(CheckpointError, match="symlink to .*gone.json.* does "
                     "not exist"):
    spikes.RollbackRecord(str(tmp_path))


def test_a_huge_spike_record_is_refused_by_its_size(tmp_path):
  with open(tmp_path / spikes.BATCHES_FILE, "w") as f:
    f.write('{"rollbacks": [], "pad": "')
    f.write("x" * (run_files.MAX_JSON_BYTES + 1))
    f.write('"}')
  with pytest.raises(CheckpointError, match=r"holds \d+ bytes"):
    spikes.RollbackRecord(str(tmp_path))
