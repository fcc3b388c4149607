"""The installed distribution: framework, models and the command-line apps.

The apps live in scripts/ (run as `python scripts/train.py`) and install as
the package `distloop_cli`, not under the generic name `scripts`. What stays
in the repository: scripts/benchmarks/, scripts/examples/, scripts/configs/,
the benchmark forwarders, the reference generator and tests/.
"""

import setuptools
from setuptools.command import build_py

# Modules of scripts/ that are repository tools, not part of the product.
_NOT_INSTALLED = ("benchmark", "gen_reference")


class BuildPy(build_py.build_py):
  """Leaves the repository tools in scripts/ out of distloop_cli."""

  def find_package_modules(self, package, package_dir):
    modules = super().find_package_modules(package, package_dir)
    if package != "distloop_cli":
      return modules
    return [(pkg, module, path) for pkg, module, path in modules
            if not module.startswith(_NOT_INSTALLED)]


setuptools.setup(
    packages=setuptools.find_packages(
        include=["framework", "framework.*", "models", "models.*"]) +
    ["distloop_cli"],
    package_dir={"distloop_cli": "scripts"},
    cmdclass={"build_py": BuildPy},
)
