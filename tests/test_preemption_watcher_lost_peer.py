"""A PreemptionCheckpointHandler's peer watcher that loses the chief (kill
-9 of worker:0 under multi_worker_mirrored) is one warning line, not an
"Exception in thread PeerTerminationWatcher" traceback; other threads'
exceptions are printed as before."""

import threading

import pytest
import tensorflow as tf

from framework.core import actions


@pytest.fixture
def printed(monkeypatch):
  """The thread exceptions that reach the hook that prints tracebacks."""
  seen = []
  monkeypatch.setattr(threading, "excepthook",
                      lambda args: seen.append((args.thread.name,
                                                args.exc_type)))
  monkeypatch.setattr(actions, "_previous_excepthook", None)
  actions._quiet_lost_peers()  # pylint: disable=protected-access
  return seen


def _raise_in(name, error):
  def target():
    raise error
  thread = threading.Thread(target=target, name=name)
  thread.start()
  thread.join()


def test_a_lost_chief_in_the_peer_watcher_is_no_traceback(printed):
  _raise_in("PeerTerminationWatcher-1",
            tf.errors.UnavailableError(None, None, "Socket closed"))
  assert not printed


def test_other_threads_still_print_their_traceback(printed):
  _raise_in("PeerTerminationWatcher-1", ValueError("a bug of ours"))
  _raise_in("mine", tf.errors.UnavailableError(None, None, "x"))
  assert printed == [("PeerTerminationWatcher-1", ValueError),
                     ("mine", tf.errors.UnavailableError)]
