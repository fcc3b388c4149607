"""Publishing a converted dataset so that readers see the old set or the new
one, never a mix.

    <output_dir>/dataset.json          {"format": "distloop.tfrecord-set/1",
                                        "generation": G, "folder": "gen-G"}
    <output_dir>/gen-G/train.json, test.json, train-*.tfrecord, ...

The converter writes everything into a staging folder inside `output_dir`
(`.make_tfrecords-<host>-<pid>-<random>`), renames it to `gen-<G>` (G: a
digest of the content, so an identical re-conversion is the same
generation), and then replaces `dataset.json` with one `os.replace`: that
rename is the only moment the set changes. Only after it are the previous
generation's folder and files of the older flat layout (`train.json` and
shards directly in `output_dir`) removed. A converter killed at any point
leaves either the old pointer (and an unused staging or `gen-` folder, which
the next converter run removes) or the new one.

A folder without `dataset.json` is read as the flat layout that
`write_split` writes (and older converters wrote).
"""

import json
import os
import re
import shutil
import socket
import tempfile

from framework.errors import DataError

POINTER = "dataset.json"
POINTER_FORMAT = "distloop.tfrecord-set/1"
STAGING_PREFIX = ".make_tfrecords-"
_STAGING = re.compile(re.escape(STAGING_PREFIX) +
                      r"(?P<host>.+)-(?P<pid>\d+)-[\w]+")
_STAGED_POINTER = re.compile(r"\.dataset\.json\.(?P<host>.+)-(?P<pid>\d+)")
_GENERATION_FOLDER = re.compile(r"gen-[0-9a-f]{16}")
_FLAT_FILES = re.compile(r"(train|test)(\.json|-\d{5}-of-\d{5}\.tfrecord)")


def _host():
  return re.sub(r"[^\w.]", "_", socket.gethostname()) or "host"


def resolve(data_dir):
  """The folder holding the sidecars and shards of `data_dir` (its current
  generation's folder, or `data_dir` itself in the flat layout)."""
  path = os.path.join(data_dir, POINTER)
  if not os.path.exists(path):
    return data_dir
  try:
    with open(path) as f:
      pointer = json.load(f)
  except (OSError, ValueError) as e:
    raise DataError(f"{path} cannot be read: {e}") from None
  folder = pointer.get("folder") if isinstance(pointer, dict) else None
  if (not isinstance(pointer, dict) or
      pointer.get("format") != POINTER_FORMAT or
      not isinstance(folder, str) or
      not _GENERATION_FOLDER.fullmatch(folder)):
    raise DataError(f"{path} is not a {POINTER_FORMAT} pointer (expected "
                    '{"format": ..., "generation": ..., "folder": '
                    '"gen-<16 hex digits>"}; re-convert with '
                    "scripts/make_tfrecords.py)")
  resolved = os.path.join(data_dir, folder)
  if not os.path.isdir(resolved):
    raise DataError(f"{path} points to {folder}/, which is missing "
                    "(re-convert with scripts/make_tfrecords.py)")
  return resolved


def _pid_alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:  # EPERM: alive, someone else's.
    return True
  return True


def remove_stale_staging(*folders):
  """Removes staging folders of converters that died on this host; returns
  their paths. Only distloop's own names are touched."""
  removed = []
  for folder in folders:
    try:
      names = os.listdir(folder)
    except OSError:
      continue
    for name in names:
      match = _STAGING.fullmatch(name) or _STAGED_POINTER.fullmatch(name)
      path = os.path.join(folder, name)
      if (match and match.group("host") == _host() and
          not _pid_alive(int(match.group("pid")))):
        if os.path.isdir(path):
          shutil.rmtree(path, ignore_errors=True)
        else:
          os.remove(path)
        removed.append(path)
  return removed


def make_staging(output_dir):
  """A new staging folder in `output_dir` named for this process."""
  return tempfile.mkdtemp(
      prefix=f"{STAGING_PREFIX}{_host()}-{os.getpid()}-", dir=output_dir)


def _fsync(path):
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def publish(staging, output_dir, generation, file_op=None):
  """Makes the content of `staging` the current set of `output_dir`.

  `file_op(what)`, if given, is called before each file operation (a test
  hook: the converter can stop itself there).
  """
  file_op = file_op or (lambda what: None)
  folder = f"gen-{generation}"
  target = os.path.join(output_dir, folder)
  try:
    current = resolve(output_dir)
  except DataError:  # A damaged pointer: the new one replaces it.
    current = None
  if current == target:
    file_op("remove identical staging")
    shutil.rmtree(staging, ignore_errors=True)
    return target
  if os.path.exists(target):  # Unused: a publish killed before the pointer.
    file_op(f"remove unused {folder}")
    shutil.rmtree(target)
  file_op(f"rename staging to {folder}")
  os.rename(staging, target)
  _fsync(output_dir)
  pointer = {"format": POINTER_FORMAT, "generation": generation,
             "folder": folder}
  tmp = os.path.join(output_dir, f".{POINTER}.{_host()}-{os.getpid()}")
  file_op("write pointer")
  with open(tmp, "w") as f:
    json.dump(pointer, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  file_op("replace pointer")
  os.replace(tmp, os.path.join(output_dir, POINTER))
  _fsync(output_dir)
  for name in sorted(os.listdir(output_dir)):
    path = os.path.join(output_dir, name)
    if _GENERATION_FOLDER.fullmatch(name) and name != folder:
      file_op(f"remove old {name}")
      shutil.rmtree(path, ignore_errors=True)
    elif _FLAT_FILES.fullmatch(name) and os.path.isfile(path):
      file_op(f"remove old {name}")
      os.remove(path)
  return target
