"""The scale-out cost model, on paper: step time over N hosts and a link.

    python scripts/benchmarks/network_model.py [--overhead_ms=5] [--compute_ms=...]

    step time = compute + wire bytes / bandwidth + collective overhead
    wire bytes per worker (ring all-reduce) = 2 (N - 1) / N x gradient bytes
    collective overhead = 2 (N - 1) x per-hop overhead (one ring step each)

Prints, for each model, link and host count, the communication time per
step (nothing overlapped) and the compute time per step a worker needs for
a scaling efficiency compute / step time of at least 0.95 (19 x the
communication). Parameter counts are distloop's own models at their
default sizes. No TensorFlow, no network.
"""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

FLAGS = flags.FLAGS
# Parameters of models.build_model(...) at the defaults (counted once).
MODELS = {"cifar_cnn": 1_676_982, "unet": 7_768_995, "100M": 100_000_000}
flags.DEFINE_list("hosts", ["2", "8", "64", "256"], "Host counts.")
flags.DEFINE_list("gbits", ["1", "10", "100"], "Link bandwidths, Gbit/s.")
flags.DEFINE_float("overhead_ms", 1.0, "Per-hop overhead of one ring step "
                   "(fitted: see the results page).")
flags.DEFINE_integer("bytes_per_value", 4, "4: float32 reduction, 2: "
                     "--all_reduce_dtype=bfloat16.")


def comm_seconds(params, hosts, gbits, overhead_s, bytes_per_value=4):
  """Seconds of one ring all-reduce of `params` values over `hosts`."""
  if hosts == 1:
    return 0.0
  wire = 2 * (hosts - 1) / hosts * params * bytes_per_value
  return wire * 8 / (gbits * 1e9) + 2 * (hosts - 1) * overhead_s


def main(argv):
  del argv
  print(f"per-hop overhead {FLAGS.overhead_ms} ms, {FLAGS.bytes_per_value} "
        "bytes per gradient value")
  print("| model | params | Gbit/s | "
        + " | ".join(f"{h} hosts" for h in FLAGS.hosts) + " |")
  print("|---|---|---|" + "---|" * len(FLAGS.hosts))
  for name, params in MODELS.items():
    for gbits in FLAGS.gbits:
      cells = []
      for hosts in FLAGS.hosts:
        t = comm_seconds(params, int(hosts), float(gbits),
                         FLAGS.overhead_ms / 1e3, FLAGS.bytes_per_value)
        cells.append(f"{_ms(t)} (>= {_ms(19 * t)})")
      print(f"| {name} | {params / 1e6:.1f} M | {gbits} | "
            + " | ".join(cells) + " |")


def _ms(seconds):
  return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


if __name__ == "__main__":
  app.run(main)
