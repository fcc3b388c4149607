"""A resume that changes global_batch_size (allow_config_change) over a
spike_batches.json says in one warning that its batch indices now name
other examples; without a record, or with the batch size kept, it does
not."""

import json
import types

from absl import logging
import pytest

from framework.app import resume
from framework.core import spikes


def _controller(tmp_path, changes, rollback):
  if rollback:
    (tmp_path / spikes.BATCHES_FILE).write_text(json.dumps({"rollbacks": [
        {"spike_step": 78, "checkpoint_step": 60,
         "batches": list(range(60, 78))}]}))
  return types.SimpleNamespace(
      step=120, config=types.SimpleNamespace(train_steps=140),
      checkpoints=types.SimpleNamespace(config_changes=changes),
      rollbacks=spikes.RollbackRecord(str(tmp_path)))


@pytest.mark.parametrize("changes,rollback,warned", [
    ([("global_batch_size", 64, 128)], True, True),
    ([("global_batch_size", 64, 128)], False, False),
    ([("learning_rate", 0.1, 0.2)], True, False),
])
def test_a_batch_size_change_over_a_rollback_record_warns(
    tmp_path, monkeypatch, changes, rollback, warned):
  lines = []
  monkeypatch.setattr(logging, "warning",
                      lambda msg, *args: lines.append(msg % args))
  config = types.SimpleNamespace(optimizer=types.SimpleNamespace(
      schedule="constant", total_steps=None))
  resume.config_changes({}, _controller(tmp_path, changes, rollback), config)
  ours = [l for l in lines if spikes.BATCHES_FILE in l]
  assert len(ours) == int(warned), lines
  if warned:
    assert "60..77" in ours[0] and "global_batch_size=64" in ours[0]
    assert "at 128 they are other examples" in ours[0]
