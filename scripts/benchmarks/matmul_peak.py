"""This machine's float32 matmul rate now, in GFLOP/s (one line).

    python scripts/benchmarks/matmul_peak.py [--peak_matmul_size=2048]

The best of 3 chains of [size, size] @ [size, size] matmuls
(`framework.perf.flops.matmul_peak_flops`): the peak that the benchmarks'
MFU figures divide by. time_to_accuracy.py runs it before each run, in a
process of its own, because the same machine runs at different speeds on
different days. The benchmarks that measure the peak themselves import
this module for its one flag, `--peak_matmul_size`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("peak_matmul_size", 2048, "Side of the square float32 "
                     "matmuls that measure the machine's peak, the MFU's "
                     "denominator (smaller: faster, further below the "
                     "peak).", lower_bound=64)


def main(argv):
  del argv
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # stdout: the figure
  from framework.perf import flops  # pylint: disable=g-import-not-at-top
  print(flops.matmul_peak_flops(size=FLAGS.peak_matmul_size, trials=3) / 1e9)


if __name__ == "__main__":
  app.run(main)
