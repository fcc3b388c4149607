"""What every distloop app does with an error the user can fix."""

import contextlib
import logging as py_logging
import os
import re
import sys
import threading

# A C++ log line ("I0000 00:00:1796054826.357001    6137 cudart_stub.cc:31]
# ...") and its severity: I, W, E, F = 0..3, as TF_CPP_MIN_LOG_LEVEL counts.
_CPP_LOG_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:[\d.]+ +\d+ \S+:\d+\] ")
_ABSL_PRE_INIT = "WARNING: All log messages before absl::InitializeLog()"


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


def import_tensorflow_quietly():
  """Imports TensorFlow with its C++ start-up lines held to
  TF_CPP_MIN_LOG_LEVEL (default 2: errors only).

  XLA's CUDA probe logs through absl before absl's C++ logging is
  initialised, where TF_CPP_MIN_LOG_LEVEL is not read yet: every process
  printed "All log messages before absl::InitializeLog()" and "Could not
  find cuda drivers" twice (two copies of the library). Only during the
  import, stderr (fd 2) goes through a filter that drops C++ lines below
  the level and that header; everything else passes unchanged and at once
  (so a crash inside the import still shows its output).
  """
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  if "tensorflow" in sys.modules:
    return
  try:
    min_level = int(os.environ["TF_CPP_MIN_LOG_LEVEL"])
  except ValueError:
    min_level = 0
  if min_level <= 0:
    import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
    return
  sys.stderr.flush()
  try:
    saved = os.dup(2)
  except OSError:  # No stderr to filter.
    import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
    return
  read_fd, write_fd = os.pipe()

  def forward():
    dropping = False  # A dropped line's continuation lines go too.
    with os.fdopen(read_fd, "rb") as pipe:
      for line in pipe:
        text = line.decode(errors="replace")
        match = _CPP_LOG_LINE.match(text)
        if match:
          dropping = "IWEF".index(match.group(1)) < min_level
        elif text.startswith(_ABSL_PRE_INIT):
          dropping = True
        if not dropping:
          os.write(saved, line)

  thread = threading.Thread(target=forward, daemon=True)
  thread.start()
  os.dup2(write_fd, 2)
  os.close(write_fd)
  try:
    import tensorflow  # pylint: disable=g-import-not-at-top,unused-import,redefined-outer-name
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)  # Closes the pipe's last write end: forward() ends.
    thread.join(timeout=10)
    os.close(saved)


class _LibraryInfoFilter(py_logging.Filter):
  """Drops records below WARNING logged from inside the given packages."""

  def __init__(self, package_dirs):
    super().__init__()
    self.package_dirs = tuple(os.path.join(d, "") for d in package_dirs)

  def filter(self, record):
    return (record.levelno >= py_logging.WARNING
            or not record.pathname.startswith(self.package_dirs))


def quiet_tensorflow_logs():
  """TensorFlow's and Keras's Python INFO lines (one "Reduce to ... then
  broadcast" per reduction, SavedModel and checkpoint internals) only with
  --verbosity >= 1; the run's own absl INFO lines (progress, eval, saves)
  stay, and so do every library's warnings.

  TensorFlow logs both through the "tensorflow" logger and through absl
  directly, so the filter sits on absl's handler and goes by source file.
  """
  from absl import logging  # pylint: disable=g-import-not-at-top
  handler = logging.get_absl_handler()
  for f in [f for f in handler.filters if isinstance(f, _LibraryInfoFilter)]:
    handler.removeFilter(f)
  if logging.get_verbosity() >= logging.DEBUG:
    return
  dirs = []
  for name in ("tensorflow", "keras", "tensorboard"):
    module = sys.modules.get(name)
    for path in getattr(module, "__path__", None) or ():
      dirs.append(os.path.realpath(path))
      dirs.append(os.path.abspath(path))
  handler.addFilter(_LibraryInfoFilter(dirs))


def main_running(run):
  """An absl `main(argv)` that rejects positional arguments and runs `run()`
  with one-line errors (the apps take flags only) and TensorFlow's own log
  lines held back (see `import_tensorflow_quietly`, `quiet_tensorflow_logs`).
  """
  from absl import app  # pylint: disable=g-import-not-at-top

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    import_tensorflow_quietly()
    quiet_tensorflow_logs()
    with one_line_errors():
      run()

  return main
