"""Moved to scripts/benchmarks/: this forwards to suite.py (same flags)."""

import os
import sys

_ROLES = {"compare": "fit_vs_trainer", "breakdown": "breakdown",
          "variant": "variants", "variants_speed": "variants"}
_HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
  for i, arg in enumerate(sys.argv[1:]):
    if arg.split("=")[0] in ("--role", "-role"):
      role = arg.partition("=")[2] or (sys.argv[i + 2:] or [""])[0]
      new = f"scripts/benchmarks/{_ROLES.get(role, 'suite')}.py"
      sys.exit(f"benchmark.py: error: --role={role} moved to {new} (python "
               f"{new} --strategies=NAME[:CPUS] --output_json=FILE ...)")
  suite = os.path.join(_HERE, "benchmarks", "suite.py")
  os.execv(sys.executable, [sys.executable, suite, *sys.argv[1:]])
