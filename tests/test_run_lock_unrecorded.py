"""A second writer that meets a lock whose holder has not recorded itself
yet (it is still starting: the record is written before its first write)
is told so, not `in use by pid ? on host ? since ?`."""

import pytest

from framework.core.checkpoints.run_files import RunLock
from framework.errors import ModelDirError


def test_unrecorded_holder_is_named_as_starting(tmp_path):
  with RunLock(str(tmp_path)):
    with pytest.raises(ModelDirError) as raised:
      RunLock(str(tmp_path)).acquire()
  message = str(raised.value)
  assert "?" not in message, message
  assert "in use by another process" in message, message
  assert "wait for that run to end or use another model_dir" in message


def test_recorded_holder_is_named(tmp_path):
  with RunLock(str(tmp_path)) as lock:
    lock.record()
    with pytest.raises(ModelDirError, match=r"in use by pid \d+ on host "):
      RunLock(str(tmp_path)).acquire()
