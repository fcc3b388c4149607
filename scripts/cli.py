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
