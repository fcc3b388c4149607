"""Moved to scripts/benchmarks/multi_worker.py: this forwards to it."""

import os
import sys

if __name__ == "__main__":
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "benchmarks", "multi_worker.py")
  os.execv(sys.executable, [sys.executable, script, *sys.argv[1:]])
