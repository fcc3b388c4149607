"""A doctored model_dir/spike_batches.json (a directory, out-of-range or
boolean indices, a checkpoint after its spike) is one CheckpointError
naming the file, never a traceback from deeper down; a good one reads."""

import json

import pytest

from framework.core import spikes
from framework.errors import CheckpointError


def _rollback(**fields):
  return {"rollbacks": [{"spike_step": 7, "checkpoint_step": 4,
                         "batches": [4, 5, 6], **fields}]}


@pytest.mark.parametrize("damage", [
    "directory",
    _rollback(batches=[10**30]),
    _rollback(batches=[True]),
    _rollback(batches=[-1]),
    _rollback(spike_step=2),
    _rollback(checkpoint_step=2**70),
])
def test_a_doctored_record_is_one_error_naming_it(tmp_path, damage):
  path = tmp_path / spikes.BATCHES_FILE
  if damage == "directory":
    path.mkdir()
  else:
    path.write_text(json.dumps(damage))
  with pytest.raises(CheckpointError, match="is not a spike_batches record"
                     ) as error:
    spikes.RollbackRecord(str(tmp_path))
  assert str(path) in str(error.value)
  assert "\n" not in str(error.value)


def test_a_good_record_reads(tmp_path):
  (tmp_path / spikes.BATCHES_FILE).write_text(json.dumps(_rollback()))
  record = spikes.RollbackRecord(str(tmp_path))
  assert record.skipped == [4, 5, 6] and record.rolled_back_steps == 3
