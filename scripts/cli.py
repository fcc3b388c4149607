"""What every distloop app does with an error the user can fix."""

import contextlib
import os
import sys


@contextlib.contextmanager
def one_line_errors():
  """Turns a `DistloopError` into one stderr line and exit status 1.

  The line is `<script>: error: <message>`, with no traceback: the message
  already names the argument, its value and what would be valid.
  """
  from framework.errors import DistloopError  # pylint: disable=g-import-not-at-top
  try:
    yield
  except DistloopError as e:
    print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
    sys.exit(1)


def main_running(run):
  """An absl `main(argv)` that rejects positional arguments and runs `run()`
  with one-line errors (the apps take flags only)."""
  from absl import app  # pylint: disable=g-import-not-at-top

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    with one_line_errors():
      run()

  return main
