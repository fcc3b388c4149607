"""Actions return what they decide and write no Controller field: a run
with the best checkpoint, early stopping with the best weights restored,
a `stop_when` target and the NaN guard sets no attribute of its Controller
while any of them runs; the Controller applies their `Stop`s."""


import pytest

from framework.app import experiment
from framework.core import actions, controller
from framework.core.checkpoints import best as best_lib
from test_best_checkpoint import _config

_ACTIVE = []


def _recording(method):
  def wrapped(self, *args, **kwargs):
    _ACTIVE.append(type(self).__name__)
    try:
      return method(self, *args, **kwargs)
    finally:
      _ACTIVE.pop()
  return wrapped


@pytest.mark.slow
def test_no_action_sets_a_controller_attribute(tmp_path, monkeypatch):
  written = []
  plain_setattr = controller.Controller.__setattr__

  def setattr_(self, name, value):
    if _ACTIVE:
      written.append((_ACTIVE[-1], name))
    plain_setattr(self, name, value)

  monkeypatch.setattr(controller.Controller, "__setattr__", setattr_)
  calls = {}
  for cls, name in ((best_lib.BestCheckpoint, "__call__"),
                    (best_lib.BestCheckpoint, "_on_train_end"),
                    (best_lib.BestCheckpoint, "finished"),
                    (actions.StopWhen, "__call__"),
                    (actions.NanGuard, "__call__")):
    method = getattr(cls, name)
    calls[(cls.__name__, name)] = 0

    def counted(self, *args, _method=method, _key=(cls.__name__, name),
                **kwargs):
      calls[_key] += 1
      return _method(self, *args, **kwargs)
    monkeypatch.setattr(cls, name, _recording(counted))
  stops = []
  plain_stop = controller.Controller.request_stop

  def request_stop(self, reason="requested"):
    stops.append((tuple(_ACTIVE), reason))
    plain_stop(self, reason)
  monkeypatch.setattr(controller.Controller, "request_stop", request_stop)

  config = _config(tmp_path / "run", restore_best_on_stop=True,
                   stop_when="eval/accuracy>=0.9999")
  results = experiment.run(config)
  # Early stopping decided, the Controller applied it (outside the action).
  assert [reason.split(":")[0] for _, reason in stops] == ["early stopping"]
  assert all(not active for active, _ in stops)
  assert all(count > 0 for key, count in calls.items()
             if key != ("BestCheckpoint", "finished")), calls
  # The best weights' evaluation is what the run reports.
  best = best_lib.read_best(str(tmp_path / "run"))
  assert results["accuracy"] == pytest.approx(best["metrics"]["accuracy"])
  assert written == []
  # A relaunch: `finished` hands its record back; nothing is written either.
  results = experiment.run(config)
  assert calls[("BestCheckpoint", "finished")] == 2 and written == []
  assert results["accuracy"] == pytest.approx(best["metrics"]["accuracy"])
