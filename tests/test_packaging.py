"""The installed product: framework, models and the command-line apps only.

Builds a wheel from a copy of the repository, checks what it holds, installs
it into a fresh virtual environment and runs the console entry points from
another folder.

The new environment sees the packages of the environment that runs the
tests (a venv, a conda env or a system Python alike) through a `.pth` file
naming that environment's site-packages folders, so TensorFlow is not
installed again and no network is needed. `--system-site-packages` would
not do: inside a venv it reaches the base interpreter's packages, not the
venv's. The folders are named as plain paths, so the `.pth` files in them
(among them the editable install of this checkout) are not run: `framework`
can only come from the installed wheel.
"""

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md",
           "framework", "models", "scripts")


def _site_packages():
  """This environment's site-packages folders, in its own order."""
  folders = [*site.getsitepackages(), sysconfig.get_paths()["purelib"],
             sysconfig.get_paths()["platlib"]]
  if site.ENABLE_USER_SITE:
    folders.append(site.getusersitepackages())
  return [f for f in dict.fromkeys(folders) if os.path.isdir(f)]


def _venv_seeing_this_environment(venv, cwd):
  """A fresh venv whose Python imports this environment's packages after
  its own (the wheel installed into it comes first)."""
  proc = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
              cwd=cwd)
  assert proc.returncode == 0, proc.stderr[-2000:]
  python = venv / "bin" / "python"
  proc = _run([str(python), "-c", "import sysconfig; "
               "print(sysconfig.get_paths()['purelib'])"], cwd=cwd)
  assert proc.returncode == 0, proc.stderr[-2000:]
  inner = proc.stdout.strip()
  with open(os.path.join(inner, "_outer_environment.pth"), "w") as f:
    f.write("".join(folder + "\n" for folder in _site_packages()))
  return python


def _run(args, cwd, timeout=600):
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["TF_CPP_MIN_LOG_LEVEL"] = "2"
  return subprocess.run(args, cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_wheel_holds_the_product_and_its_entry_points_run(tmp_path):
  src = tmp_path / "src"
  for name in SOURCES:  # A copy: building in the checkout would leave build/.
    path = os.path.join(ROOT, name)
    if os.path.isdir(path):
      shutil.copytree(path, src / name, ignore=shutil.ignore_patterns(
          "__pycache__", "*.pyc"))
    else:
      os.makedirs(src, exist_ok=True)
      shutil.copy(path, src / name)
  # No build isolation: the test must not need the network.
  proc = _run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
               "--no-build-isolation", "-q", "-w", str(tmp_path / "wheel")],
              cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (wheel,) = (tmp_path / "wheel").glob("distloop-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  top = {name.split("/")[0] for name in names}
  assert top == {"framework", "models", "distloop_cli",
                 wheel.name.split("-py")[0] + ".dist-info"}, top
  assert not [n for n in names if "benchmark" in n or "/tests/" in n or
              "/examples/" in n or "/configs/" in n or "gen_reference" in n]
  for app in ("train", "evaluate", "predict", "launch", "make_tfrecords"):
    assert f"distloop_cli/{app}.py" in names
  assert "framework/core/trainer.py" in names
  assert "models/cifar_cnn.py" in names

  venv = tmp_path / "venv"
  python = _venv_seeing_this_environment(venv, tmp_path)
  bin_dir = venv / "bin"
  # The outer environment's pip installs into the new one: a venv made
  # without pip needs no ensurepip (which some Pythons lack).
  proc = _run([sys.executable, "-m", "pip", "--python", str(python),
               "install", "-q", "--no-deps", "--no-index", str(wheel)],
              cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]

  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  proc = _run([str(bin_dir / "python"), "-c",
               "import framework, distloop_cli.train as t; "
               "print(framework.__file__); print(t.__file__)"], cwd=elsewhere)
  assert proc.returncode == 0, proc.stderr[-2000:]
  for line in proc.stdout.split():
    assert line.startswith(str(venv)), line  # Not the repository's copy.

  # absl exits 1 after printing help; the flags are what counts.
  proc = _run([str(bin_dir / "distloop-train"), "--helpshort"], cwd=elsewhere)
  assert proc.returncode in (0, 1), proc.stderr[-2000:]
  for flag in ("--model_dir", "--strategy", "--global_batch_size"):
    assert flag in proc.stdout, proc.stdout[-2000:]
  proc = _run([str(bin_dir / "distloop-train"), "--model=mlp",
               "--dataset=synthetic", "--train_steps=2", "--steps_per_loop=1",
               "--noexport_saved_model", "--model_dir=runs/installed"],
              cwd=elsewhere)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (elsewhere / "runs" / "installed" / "model.weights.h5").exists()
  proc = _run([str(bin_dir / "distloop-evaluate"),
               "--model_dir=runs/installed"], cwd=elsewhere)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "accuracy" in proc.stdout + proc.stderr
