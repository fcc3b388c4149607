"""When the chief of a multi_worker_mirrored job dies (kill -9 of worker:0),
the other workers' PreemptionCheckpointHandler, which talks to the chief's
coordination service, is one warning line, not a traceback: its peer
watcher thread, and its SIGTERM handler when the launcher then stops the
task; other threads' exceptions are printed as before."""

import os
import signal
import threading
import time

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


def test_a_sigterm_after_the_chief_died_is_no_traceback(monkeypatch):
  def handler_of_tf(signum, frame):  # as TensorFlow's, the chief gone
    del signum, frame
    raise tf.errors.UnavailableError(None, None, "Connection refused")

  previous = signal.signal(signal.SIGTERM, handler_of_tf)
  try:
    warnings = []
    monkeypatch.setattr(actions.logging, "warning",
                        lambda *args: warnings.append(args[0] % args[1:]))
    actions._tolerate_a_lost_coordinator()  # pylint: disable=protected-access
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(50):  # the handler runs between bytecodes
      if warnings:
        break
      time.sleep(0.1)
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert len(warnings) == 1 and "Connection refused" in warnings[0], warnings
