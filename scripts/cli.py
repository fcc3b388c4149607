"""What every distloop app does with an error the user can fix, and with
TensorFlow's own log lines (quiet unless asked for)."""

import contextlib
import errno
import gc
import glob
import importlib.util
import logging as py_logging
import os
import re
import signal
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
  already names the argument, its value and what would be valid. A Ctrl-C
  that arrives before training installs its own handler (imports, data
  loading) is one line and exit status 130, as a shell reports SIGINT.
  """
  from framework.errors import DistloopError  # pylint: disable=g-import-not-at-top
  script = os.path.basename(sys.argv[0])
  try:
    yield
  except DistloopError as e:
    print(f"{script}: error: {e}", file=sys.stderr)
    if _is_configuration_error(e):
      mark_configuration_error(f"{script}: error: {e}")
    sys.exit(1)
  except Exception as e:  # pylint: disable=broad-except
    # A damaged shard or record stops a tf.data pipeline wherever it is
    # consumed (training, evaluation, prediction): its message says so.
    from framework.data import integrity  # pylint: disable=g-import-not-at-top
    message = integrity.data_error(e) if _is_op_error(e) else None
    if message is None:
      message = _unwritable(e)
    if message is None:
      raise
    print(f"{script}: error: {message}", file=sys.stderr)
    sys.exit(1)
  except KeyboardInterrupt:
    print(f"{script}: interrupted (Ctrl-C) outside the training loop; nothing "
          "was saved", file=sys.stderr)
    sys.exit(130)


# The launcher (framework.distribute.launcher) names a file per task in this
# variable; a task that ends with a configuration error writes its line
# there, and `launch.py --max_restarts` does not start it again.
ERROR_FILE_ENV = "DISTLOOP_ERROR_FILE"


def _is_configuration_error(error):
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  return isinstance(error, ConfigError)


def mark_configuration_error(line):
  """Writes `line` to $DISTLOOP_ERROR_FILE (if set): this process ended
  with a configuration error, which no restart can mend."""
  path = os.environ.get(ERROR_FILE_ENV)
  if not path:
    return
  try:
    with open(path, "w") as f:
      f.write(line.rstrip("\n") + "\n")
  except OSError:
    pass  # The launcher then retries as it would without the mark.


def parse_flags(argv):
  """absl's flag parsing (`app.run(main, flags_parser=parse_flags)`); a
  flag it rejects (unknown, bad value) is also marked as a configuration
  error (see `mark_configuration_error`)."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    mark_configuration_error("FATAL Flags parsing error: "
                             + " ".join(str(e).split()))
  # Parses again, to fail and print exactly as absl does.
  return app.parse_flags_with_usage(argv)


def _is_op_error(error):
  tf = sys.modules.get("tensorflow")
  return tf is not None and isinstance(error, tf.errors.OpError)


# What the OS says when a folder cannot be written: the user's to fix.
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC,
               errno.EDQUOT)


def _unwritable(error):
  """One line for a permission / read-only / full-disk error, else None.

  Python's OSError carries the path and errno; TensorFlow's file writers
  (summaries, checkpoints) raise PermissionDeniedError or
  ResourceExhaustedError whose first line holds the path and the OS's words.
  """
  if isinstance(error, OSError) and error.errno in _UNWRITABLE:
    where = f" {error.filename}" if error.filename else ""
    return f"cannot write{where} ({error.strerror})"
  tf_errors = getattr(sys.modules.get("tensorflow"), "errors", None)
  if tf_errors is None or not isinstance(
      error, (tf_errors.PermissionDeniedError,
              tf_errors.ResourceExhaustedError)):
    return None
  lines = [l.strip() for l in str(error).splitlines() if l.strip()]
  first = re.sub(r"^\{\{[^}]*\}\}\s*", "", lines[0]) if lines else ""
  if isinstance(error, tf_errors.ResourceExhaustedError) and not re.search(
      r"space|quota|disk", first, re.I):
    return None  # out of memory, not a folder
  return f"cannot write {first}"


def import_tensorflow_quietly():
  """Imports TensorFlow with its C++ start-up lines held to
  TF_CPP_MIN_LOG_LEVEL (default 2: errors only).

  XLA's CUDA probe logs through absl before absl's C++ logging is
  initialised, where TF_CPP_MIN_LOG_LEVEL is not read yet: every process
  printed "All log messages before absl::InitializeLog()" and "Could not
  find cuda drivers" twice (two copies of the library).
  """
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  if "tensorflow" in sys.modules:
    return
  try:
    min_level = int(os.environ["TF_CPP_MIN_LOG_LEVEL"])
  except ValueError:
    min_level = 0
  with filtered_stderr(min_level, drop=_cpu_only_noise()), \
      collection_paused():
    import tensorflow  # pylint: disable=g-import-not-at-top
    # The platforms are probed once, at the first device query: here, so
    # that a CPU-only machine's "failed call to cuInit" line is dropped
    # (logical CPU devices can still be configured afterwards).
    tensorflow.config.list_physical_devices("CPU")


def _cpu_only_noise():
  """Patterns of C++ error lines that mean nothing on a machine without an
  NVIDIA driver (no /dev/nvidia*): the CUDA probe's failed cuInit."""
  if glob.glob("/dev/nvidia*"):
    return ()
  return (re.compile(r"failed call to cuInit"),)


@contextlib.contextmanager
def collection_paused():
  """Python's cyclic garbage collector off while inside; afterwards what
  was made inside is frozen out of its generations (`gc.freeze`).

  Importing TensorFlow allocates ~600,000 long-lived objects and the
  collector walked them again and again: ~20 % of the import's CPU time
  (perf). Frozen, the collections while a run traces its functions skip
  them too: a 10-step `train.py --model=mlp` run took 8.2 s instead of
  10.6 s (idle, 2 cores, same weights).
  """
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()
    gc.freeze()


@contextlib.contextmanager
def filtered_stderr(min_level, drop=()):
  """Drops C++ log lines below `min_level` (0..3 = I, W, E, F, as
  TF_CPP_MIN_LOG_LEVEL counts), C++ log lines matching a pattern of `drop`
  and absl's pre-initialisation header from file descriptor 2 while inside.

  Everything else passes unchanged and at once (so that a crash inside
  still shows its output); a dropped line's continuation lines go too.
  """
  sys.stderr.flush()
  try:
    saved = os.dup(2) if min_level > 0 else None
  except OSError:  # No stderr to filter.
    saved = None
  if saved is None:
    yield
    return
  read_fd, write_fd = os.pipe()

  def forward():
    dropping = False
    with os.fdopen(read_fd, "rb") as pipe:
      for line in pipe:
        text = line.decode(errors="replace")
        match = _CPP_LOG_LINE.match(text)
        if match:
          dropping = ("IWEF".index(match.group(1)) < min_level
                      or any(p.search(text) for p in drop))
        elif text.startswith(_ABSL_PRE_INIT):
          dropping = True
        if not dropping:
          os.write(saved, line)

  thread = threading.Thread(target=forward, daemon=True)
  thread.start()
  os.dup2(write_fd, 2)
  os.close(write_fd)
  try:
    yield
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
  # A script that imported TensorFlow before its flags were parsed (and
  # logged) has the "tensorflow" logger printing through a handler of its
  # own or the root's: filter that logger too.
  tf_logger = py_logging.getLogger("tensorflow")
  for target in (handler, tf_logger):
    for f in [f for f in target.filters
              if isinstance(f, _LibraryInfoFilter)]:
      target.removeFilter(f)
  if logging.get_verbosity() >= logging.DEBUG:
    return
  dirs = []
  for name in ("tensorflow", "keras", "tensorboard"):
    spec = importlib.util.find_spec(name)
    for path in (spec and spec.submodule_search_locations) or ():
      dirs += [os.path.abspath(path), os.path.realpath(path)]
  handler.addFilter(_LibraryInfoFilter(dirs))
  tf_logger.addFilter(_LibraryInfoFilter(dirs))


def quiet_startup(*, import_tensorflow=True):
  """Called at the top of every app, before TensorFlow is imported: a run
  shows its own lines (progress, eval, saves, errors) and C++ errors;
  TF_CPP_MIN_LOG_LEVEL=0 brings TensorFlow's C++ lines back, --verbosity=1
  its Python ones.

  Once absl has parsed the flags (so that `--help` stays fast), TensorFlow
  is imported through `import_tensorflow_quietly` (unless
  `import_tensorflow=False`, for an app that never imports it) and
  `quiet_tensorflow_logs` is applied.
  """
  from absl import app  # pylint: disable=g-import-not-at-top
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  handle_ctrl_c()

  def after_flags():
    apply_malloc_flag()
    apply_onednn_flag()
    if import_tensorflow:
      import_tensorflow_quietly()
    quiet_tensorflow_logs()

  app.call_after_init(after_flags)


def handle_ctrl_c():
  """Ctrl-C (SIGINT) raises KeyboardInterrupt, even where the process was
  started with SIGINT ignored.

  A shell without job control starts `cmd &` with SIGINT ignored, and
  Python then leaves it so: `kill -INT` did nothing until training
  installed its own handler. Distloop handles SIGINT in every phase (here:
  one line, exit 130; in training: a checkpoint, exit 42), as it does
  SIGTERM.
  """
  if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def apply_onednn_flag():
  """--onednn=on|off (in apps that define it) as TF_ENABLE_ONEDNN_OPTS,
  which TensorFlow reads once, when it loads: before that."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  if "onednn" not in flags.FLAGS or flags.FLAGS.onednn == "default":
    return
  if "tensorflow" in sys.modules:
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning("--onednn=%s has no effect: TensorFlow was loaded "
                    "before the flags were parsed", flags.FLAGS.onednn)
  os.environ["TF_ENABLE_ONEDNN_OPTS"] = (
      "1" if flags.FLAGS.onednn == "on" else "0")


def apply_malloc_flag():
  """--malloc=tcmalloc (in apps that define it): starts the app again with
  tcmalloc preloaded, before TensorFlow loads (see framework.perf.allocator);
  a missing library is one error line."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  if "malloc" not in flags.FLAGS or flags.FLAGS.malloc == "default":
    return
  from framework.perf import allocator  # pylint: disable=g-import-not-at-top
  if "tensorflow" in sys.modules:
    if not allocator.tcmalloc_loaded():
      from absl import logging  # pylint: disable=g-import-not-at-top
      logging.warning("--malloc=%s has no effect: TensorFlow was loaded "
                      "before the flags were parsed", flags.FLAGS.malloc)
    return
  with one_line_errors():
    allocator.reexec_with(flags.FLAGS.malloc)


def onednn_enabled():
  """Whether TensorFlow runs its oneDNN CPU kernels in this process."""
  from framework import _tf_internal  # pylint: disable=g-import-not-at-top
  return _tf_internal.onednn_enabled()


def warn_unread_flags(*, extra=None, table=None):
  """Prints one `<script>: warning: ...` line naming each flag set that the
  run's choices do not read (`config_flags.unread_flags`: train.py's
  settings' `read_by` and `extra`, or an app's own `table`)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  try:
    from . import config_flags  # pylint: disable=g-import-not-at-top
  except ImportError:
    from distloop_cli import config_flags  # pylint: disable=g-import-not-at-top
  text = config_flags.unread_warning(sys.argv, flags.FLAGS, extra=extra,
                                     table=table)
  if text:
    print(f"{os.path.basename(sys.argv[0])}: warning: {text}",
          file=sys.stderr)


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


def run_app(main):
  """Runs your absl `main(argv)` as distloop's own apps run.

  Flags are parsed as train.py parses them (`parse_flags`: a bad value is
  one line); errors a user can fix (`framework.DistloopError`, a damaged
  record, an unwritable folder) end in one `<script>: error: ...` line and
  exit status 1; a Ctrl-C outside the training loop in one line and 130.
  Call `quiet_startup()` at the top of the script, before TensorFlow is
  imported, for train.py's quiet logs; `framework.run` and the Controller
  print the progress lines.

      from distloop_cli import cli
      cli.quiet_startup()
      ...
      if __name__ == "__main__":
        cli.run_app(main)
  """
  from absl import app  # pylint: disable=g-import-not-at-top

  def main_with_one_line_errors(argv):
    with one_line_errors():
      return main(argv)

  app.run(main_with_one_line_errors, flags_parser=parse_flags)


def run_entry_point(main, module_name):
  """Runs an app from its console script (`distloop-train`, ...).

  absl's --helpshort lists the key flags of the module named like
  sys.argv[0]; run as `python scripts/train.py` that is the app itself, but
  a console script is a wrapper that defines none, so every flag not of
  absl's own (whichever module of the app defined it) is declared a key
  flag of the wrapper too.
  """
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  del module_name  # The flags are found by their defining modules.
  for module, flag_list in flags.FLAGS.flags_by_module_dict().items():
    if module.split(".")[0] != "absl":
      for flag in flag_list:
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  app.run(main, flags_parser=parse_flags)
