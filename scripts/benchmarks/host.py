"""What a benchmark says about the machine it measured on.

Flag-free, so that any benchmark can import it: `common.py` defines the
CIFAR-10 benchmarks' absl flags (--quick, --global_batch_size, ...), which
`mesh.py` and `optimizer_sharding.py` define for themselves, and absl
refuses a flag defined twice.
"""

import os

# The CPU cores the two-core benchmarks pin their processes to (taskset
# -c; multi_worker.py and network.py --cores).
PINNED_CORES = "0,1"


def cpu_model():
  """The CPU's model name: `framework.perf.peak.cpu_model`, the name the
  MFU peak is kept under (imported here, not above: it loads TensorFlow)."""
  from framework.perf import peak  # pylint: disable=g-import-not-at-top
  return peak.cpu_model()


def load_average():
  """`load average 1.00 0.50 0.25` (1, 5 and 15 minutes): on a shared
  machine every timing is slowed by the others' load."""
  load = os.getloadavg()
  return f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
