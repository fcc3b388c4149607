"""The host's matmul peak per compute dtype, measured once and kept.

    peak_flops("bfloat16")  # FLOP/s of one device of this process's kind

The first call on a host measures a chain of square matmuls in the dtype
(`flops.matmul_peak_flops`, about a second) and records it in distloop's
cache folder (`framework.data.integrity.cache_dir()`, never a run folder),
in `peak_flops.json` keyed by the device kind (the GPU's name, or the CPU's
model and the cores this process may use) and the dtype; later runs read
it. A file that cannot be read or holds no usable figure is measured again
and rewritten, never an error.
"""

import json
import os

from absl import logging

from framework.data.integrity import cache_dir
from framework.perf import flops

CACHE_FILE = "peak_flops.json"
# Big enough to reach a device's matmul rate, small enough to take about a
# second: a GPU needs far larger matrices than a CPU to fill.
_SIZES = {"GPU": 8192, "CPU": 2048}
# FLOP/s a device's matmuls can have: a figure outside (a doctored file)
# would make every MFU about 0 or huge, so it is measured again.
_PLAUSIBLE = (1e6, 1e17)
# Far more than the entries of every device kind and dtype of a host.
_MAX_BYTES = 1 << 20


def cache_path() -> str:
  return os.path.join(cache_dir(), CACHE_FILE)


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
  """The CPU's model name (Linux `/proc/cpuinfo`), else what `platform`
  knows of the processor or machine, else "unknown CPU"."""
  try:
    with open(cpuinfo) as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  import platform  # pylint: disable=g-import-not-at-top
  return platform.processor() or platform.machine() or "unknown CPU"


def device_kind(device_type: str = "CPU") -> str:
  """What a peak is kept under: the first GPU's name, or the CPU's model
  and the cores this process may run on (`device_type`: GPU or CPU)."""
  if device_type == "GPU":
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
      details = tf.config.experimental.get_device_details(gpus[0])
      return f"GPU {details.get('device_name', gpus[0].name)}"
  cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count())
  return f"CPU {cpu_model()} x{cores}"


def _read(path):
  """{key: FLOP/s} of the usable entries of `path` ({} if none)."""
  # Only a regular file, and only its first bytes: a device, a pipe or a
  # huge file in its place would block or fill the memory.
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, "rb") as f:
      text = f.read(_MAX_BYTES + 1)
    if len(text) > _MAX_BYTES:
      return {}
    entries = json.loads(text)
  except (OSError, ValueError):
    return {}
  if not isinstance(entries, dict):
    return {}
  return {key: value for key, value in entries.items()
          if isinstance(value, (int, float)) and not isinstance(value, bool)
          and _PLAUSIBLE[0] <= value <= _PLAUSIBLE[1]}


def _write(path, entries):
  """Atomically; a cache folder that cannot be written is left as it is
  (the next run measures again). Returns None, or why it was not written."""
  temporary = f"{path}.{os.getpid()}.tmp"
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(temporary, "w") as f:
      json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(temporary, path)
  except OSError as e:
    try:
      os.remove(temporary)
    except OSError:
      pass
    return f"{e.strerror or e}: {e.filename or path}"
  return None


def key(dtype: str, device_type: str = "CPU") -> str:
  """The cache entry of `dtype` on this host's `device_type`."""
  return f"{device_kind(device_type)} | {dtype}"


def peak_flops(compute_dtype: str = "float32", device_type: str = "CPU",
               measure=None) -> float:
  """Matmul FLOP/s of one `device_type` device in `compute_dtype`: the cached
  figure, else measured (`measure(compute_dtype, device)`, default
  `flops.matmul_peak_flops`) and cached."""
  path, entry = cache_path(), key(compute_dtype, device_type)
  entries = _read(path)
  if entry in entries:
    return float(entries[entry])
  size = _SIZES.get(device_type, _SIZES["CPU"])
  device = f"/{device_type}:0"
  if measure is None:
    value = flops.matmul_peak_flops(size=size, trials=2,
                                    compute_dtype=compute_dtype, device=device)
  else:
    value = measure(compute_dtype, device)
  # Re-read: another process of this host may have added its entries.
  problem = _write(path, {**_read(path), entry: float(value)})
  logging.info("measured the %s matmul peak of %s: %.1f GFLOP/s (%s)",
               compute_dtype, device_kind(device_type), value / 1e9,
               f"kept in {path}" if problem is None else
               f"not kept: {problem}; the next run measures again")
  return float(value)
