"""Moved to scripts/benchmarks/model_parallel.py: this forwards to it."""

import os
import sys

if __name__ == "__main__":
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "benchmarks", "model_parallel.py")
  os.execv(sys.executable, [sys.executable, script, *sys.argv[1:]])
