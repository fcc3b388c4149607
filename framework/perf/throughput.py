"""Achieved FLOP/s, tokens/s and MFU of a training loop.

    flops_per_sec = training FLOPs per example x examples/s (global)
    mfu           = flops_per_sec / (peak of the compute dtype x devices)

`Throughput` turns a loop's examples/s into the `perf/*` outputs the
Controller logs and summarises; `peak_devices` says which peak a run's
devices divide by: each GPU it computes on counts once, and logical CPU
devices, which share one host's cores, count once per process.
"""

import dataclasses
from typing import Iterable, Optional

from framework.perf import peak

# The compute dtype of each precision (`framework.core.config.PRECISIONS`).
COMPUTE_DTYPES = {"float32": "float32", "bfloat16": "bfloat16",
                  "float16": "float16", "mixed_bfloat16": "bfloat16",
                  "mixed_float16": "float16"}


@dataclasses.dataclass(frozen=True)
class Throughput:
  """What turns examples/s into FLOP/s, tokens/s and MFU.

  Attributes:
    flops_per_example: training FLOPs of one example (forward + backward).
    peak_flops: FLOP/s of all the run's devices in `compute_dtype`.
    compute_dtype: the dtype the peak was measured in.
    tokens_per_example: tokens of one example (None: not a token model).
  """
  flops_per_example: float
  peak_flops: float
  compute_dtype: str = "float32"
  tokens_per_example: Optional[int] = None

  def outputs(self, examples_per_second: float) -> dict:
    """`perf/flops_per_sec`, `perf/mfu` (and `perf/tokens_per_sec`)."""
    achieved = self.flops_per_example * examples_per_second
    values = {"perf/flops_per_sec": achieved,
              "perf/mfu": achieved / self.peak_flops}
    if self.tokens_per_example:
      values["perf/tokens_per_sec"] = (
          self.tokens_per_example * examples_per_second)
    return values


def text(outputs) -> str:
  """The log line's part: ` tokens/s=... GFLOP/s=... MFU=...` (empty
  without `perf/mfu`)."""
  if "perf/mfu" not in outputs:
    return ""
  tokens = (f" tokens/s={outputs['perf/tokens_per_sec']:.1f}"
            if "perf/tokens_per_sec" in outputs else "")
  return (f"{tokens} GFLOP/s={outputs['perf/flops_per_sec'] / 1e9:.3g} "
          f"MFU={outputs['perf/mfu']:.4f}")


def compute_dtype(precision: str) -> str:
  """The dtype a run of `precision` (a precision or a Keras policy name)
  multiplies in."""
  return COMPUTE_DTYPES.get(precision, "float32")


def peak_devices(devices: Iterable[str], processes: int = 1):
  """(device type, count) whose peaks add up to the run's: the distinct
  GPUs among `devices` (names such as `/job:worker/replica:0/task:0/
  device:GPU:1`) per process, else one CPU per process."""
  gpus = {name.rsplit("/", 1)[-1].upper().removeprefix("DEVICE:")
          for name in devices if "GPU:" in name.upper()}
  if gpus:
    return "GPU", len(gpus) * max(processes, 1)
  return "CPU", max(processes, 1)


def for_run(flops_per_example: float, *, precision: str,
            devices: Iterable[str] = (), processes: int = 1,
            tokens_per_example: Optional[int] = None,
            measure=None) -> Throughput:
  """The `Throughput` of a run: the peak of its compute dtype on its
  devices (`peak.peak_flops`: measured once per host, then cached)."""
  dtype = compute_dtype(precision)
  device_type, count = peak_devices(devices, processes)
  one = peak.peak_flops(dtype, device_type, measure=measure)
  return Throughput(flops_per_example=float(flops_per_example),
                    peak_flops=one * count, compute_dtype=dtype,
                    tokens_per_example=tokens_per_example)
