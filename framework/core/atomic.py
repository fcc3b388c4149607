"""Files and directories that are either complete or as they were.

    write_atomically("runs/a/model.weights.h5", model.save_weights)

`write(tmp)` writes a temporary name in the same directory, which is then
renamed over the target; a full disk or a permission error removes the
temporary and is one `ModelDirError` line, and the previous file stays.
"""

import os
import re
import shutil

import tensorflow as tf

from framework.errors import ModelDirError

TMP_PREFIX = ".tmp_"
# What a process killed inside `write_atomically` can leave behind.
ORPHAN_NAMES = re.compile(
    re.escape(TMP_PREFIX) + r"(model\.weights\.h5|model_info\.json"
    r"|run_config\.json|target_reached\.json|checkpoint|export"
    r"|stopped_early\.json|best_history\.json"
    r"|metrics\.jsonl)(\.old)?")


def _reason(error):
  """The OS's words for `error` (HDF5 and TensorFlow bury the errno in a
  multi-line message)."""
  code = re.search(r"errno = (\d+)|\[Errno (\d+)\]", str(error))
  if code:
    return os.strerror(int(code.group(1) or code.group(2)))
  if isinstance(error, OSError) and error.strerror:
    return error.strerror.strip().splitlines()[0]
  lines = str(error).strip().splitlines()
  return lines[0] if lines else type(error).__name__


def _remove(path):
  if os.path.isdir(path):
    shutil.rmtree(path, ignore_errors=True)
  elif tf.io.gfile.exists(path):
    tf.io.gfile.remove(path)


def write_atomically(path, write):
  """Calls `write(tmp_path)`, then renames it to `path` (file or directory).

  Raises ModelDirError, naming `path` and the reason (e.g. "No space left on
  device"), if writing or renaming fails; `path` is then unchanged.
  """
  directory, name = os.path.split(path)
  tmp = os.path.join(directory, TMP_PREFIX + name)
  old = tmp + ".old"
  try:
    _remove(tmp)
    write(tmp)
    if os.path.isdir(tmp):
      # A directory cannot be renamed over a non-empty one: move the old
      # one aside first (a crash in between leaves it as `old`).
      _remove(old)
      if os.path.isdir(path):
        os.rename(path, old)
      os.rename(tmp, path)
      _remove(old)
    else:
      tf.io.gfile.rename(tmp, path, overwrite=True)
  except (OSError, tf.errors.OpError) as e:
    try:
      _remove(tmp)
      if os.path.isdir(old) and not os.path.exists(path):
        os.rename(old, path)
    except OSError:
      pass
    raise ModelDirError(
        f"cannot write {path} ({_reason(e)}); "
        + ("the previous version is unchanged"
           if os.path.exists(path) else "nothing was written")) from None
  return path


def write_text(path, text):
  """`write_atomically` for a text file."""

  def write(tmp):
    with tf.io.gfile.GFile(tmp, "w") as f:
      f.write(text)

  return write_atomically(path, write)
