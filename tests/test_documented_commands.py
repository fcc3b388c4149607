"""Every command the user docs show runs, as a user would type it.

The fenced shell blocks of README.md, BUILD.md and docs/guide/*.md are
extracted. Each `python scripts/...` (or `distloop-...`) command is parsed
by its own app's absl flags from a folder other than the repository root,
with its relative paths (`scripts/...`, `--flagfile=scripts/configs/...`)
rewritten to reach the repository from there: a renamed flag, a bad value
or a missing flag file fails. Every `--model_dir` that an evaluate or
predict command reads must be written by a documented train command (a
renamed run folder fails). The README's main job then runs for real at a
tiny size (slow): train, relaunch (resume), evaluate, predict and the
SavedModel, then evaluate and predict again from a third folder.
A command this test cannot run is skipped by name, with the reason below;
any other command fails until the test knows it.
"""

import configparser
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = (["README.md", "BUILD.md"] +
        sorted(os.path.relpath(p, ROOT) for p in
               glob.glob(os.path.join(ROOT, "docs", "guide", "*.md"))))
SHELL_TAGS = ("", "sh", "bash", "shell", "console")

# Commands that cannot run in a test, by their first word(s), and why.
SKIPPED = {
    "pip": "installs packages; the test runs on the installed tree",
    "python -m pytest": "the test suite itself",
    "python3 -m pytest": "the test suite itself",
    "python3 -m pip": "installs packages; the test runs on the installed tree",
    "tensorboard": "a web server, read in a browser",
    "srun": "needs a Slurm allocation",
    "sbatch": "needs a Slurm allocation",
    "kubectl": "needs a Kubernetes cluster",
    "apt-get install": "installs system packages (root)",
}
# Apps whose --model_dir is a run they write (the others read one).
WRITERS = ("train.py", "custom_step.py", "own_model_and_data.py")
READERS = ("evaluate.py", "predict.py")


def _entry_points():
  parser = configparser.ConfigParser()
  parser.read(os.path.join(ROOT, "setup.cfg"))
  text = parser.get("options.entry_points", "console_scripts", fallback="")
  result = {}
  for line in text.strip().splitlines():
    name, _, target = (part.strip() for part in line.partition("="))
    result[name] = "scripts/" + target.split(":")[0].split(".")[-1] + ".py"
  return result


def documented_commands():
  """[(where, words)] of every command in a fenced shell block."""
  found = []
  for doc in DOCS:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
      lines = f.read().split("\n")
    in_block, tag = False, None
    logical = ""
    for number, line in enumerate(lines, 1):
      stripped = line.strip()
      if stripped.startswith("```"):
        in_block, tag = (not in_block), stripped[3:].strip()
        start = number
        continue
      if not in_block or tag not in SHELL_TAGS:
        continue
      if stripped.startswith("#SBATCH"):
        # A Slurm batch script: skipped whole (SKIPPED["sbatch"]).
        found = [c for c in found if c[2] != start]
        found.append((f"{doc}:{number}", ["sbatch"], start))
        tag = "slurm"
        continue
      logical += line.rstrip()
      if logical.endswith("\\"):
        logical = logical[:-1] + " "
        continue
      text, logical = logical.strip(), ""
      if not text or text.startswith("#"):
        continue
      text = re.sub(r"\s+#.*$", "", text)  # A trailing comment.
      text = text.rstrip("&").strip()
      for part in text.split("&&"):
        found.append((f"{doc}:{number}", shlex.split(part.strip()), start))
  return [(where, words) for where, words, _ in found]


def classify(words):
  """('app', script, args), ('skip', reason, None) or ('unknown', ...)."""
  words = list(words)
  while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
    words.pop(0)  # VAR=value before a command.
  if not words:
    return "unknown", "", None
  entry = _entry_points()
  if words[0] in entry:
    return "app", entry[words[0]], words[1:]
  if (len(words) > 1 and words[0] in ("python", "python3") and
      words[1].startswith("scripts/") and words[1].endswith(".py")):
    return "app", words[1], words[2:]
  for prefix, reason in SKIPPED.items():
    if words[:len(prefix.split())] == prefix.split():
      return "skip", reason, None
  return "unknown", " ".join(words), None


def app_invocations():
  """[(where, script, args)] of every app command, inner commands of the
  launcher included; fails on a command the test does not know."""
  result, unknown = [], []
  for where, words in documented_commands():
    kind, what, args = classify(words)
    if kind == "unknown":
      unknown.append(f"{where}: {what}")
    if kind != "app":
      continue
    if "--" in args:  # scripts/launch.py [flags] -- <task command>
      inner = args[args.index("--") + 1:]
      args = args[:args.index("--")]
      inner_kind, inner_script, inner_args = classify(inner)
      if inner_kind != "app":
        unknown.append(f"{where}: launched command {' '.join(inner)}")
      else:
        result.append((where, inner_script, inner_args))
    result.append((where, what, args))
  assert not unknown, ("documented commands this test does not know (add "
                       "them to SKIPPED with a reason, or fix them):\n" +
                       "\n".join(unknown))
  return result


def _flag(args, name):
  for arg in args:
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
  return None


def _relocate(args, to_root):
  """Rewrites repository-relative paths so they work from another folder."""
  out = []
  for arg in args:
    if arg.startswith("--flagfile=scripts/"):
      arg = "--flagfile=" + os.path.join(to_root, arg.split("=", 1)[1])
    out.append(arg)
  return out


# Parses argument lists with one app's flags, without running its main.
# Each app is loaded in turn in this one process; its flags and modules are
# removed before the next one defines flags of the same names.
_CHECKER = r"""
import importlib.util, json, os, sys
from absl import app, flags, logging
FLAGS = flags.FLAGS
jobs = json.load(open(sys.argv[1]))
results = []
for script, argvs in jobs:
  flags_before, modules_before = set(FLAGS), set(sys.modules)
  spec = importlib.util.spec_from_file_location("documented_app", script)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except BaseException as e:
    results += [[script, argv, "cannot load: %r" % e] for argv in argvs]
    continue
  for argv in argvs:
    try:
      left = FLAGS([script] + argv, known_only=False)
      error = None if len(left) == 1 else "unexpected arguments %s" % left[1:]
    except BaseException as e:
      error = "%s: %s" % (type(e).__name__, e)
    FLAGS.unparse_flags()
    results.append([script, argv, error])
  for name in set(FLAGS) - flags_before:
    if name in FLAGS:
      delattr(FLAGS, name)
  for name in set(sys.modules) - modules_before:
    if (name == "documented_app"
        or name.split(".")[0] in ("scripts", "distloop_cli")):
      # The apps only (scripts/ installed as distloop_cli: an example that
      # imports distloop_cli.train defines train.py's flags again): C
      # extensions load once.
      del sys.modules[name]
json.dump(results, open(sys.argv[2], "w"))
"""


def _env():
  return dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")


def test_every_documented_command_parses_from_another_folder(tmp_path):
  invocations = app_invocations()
  assert any(script == "scripts/train.py" for _, script, _ in invocations)
  work = tmp_path / "elsewhere"
  work.mkdir()
  to_root = os.path.relpath(ROOT, work)
  jobs = {}
  for where, script, args in invocations:
    path = os.path.join(to_root, script)
    assert os.path.exists(os.path.join(work, path)), f"{where}: no {script}"
    jobs.setdefault(path, []).append(_relocate(args, to_root))
  # The recorded experiments are documented too: each flag file parses.
  train = os.path.join(to_root, "scripts", "train.py")
  for cfg in sorted(glob.glob(os.path.join(ROOT, "scripts", "configs", "*.cfg"))):
    jobs.setdefault(train, []).append(
        ["--flagfile=" + os.path.relpath(cfg, work)])
  job_file, result_file = tmp_path / "jobs.json", tmp_path / "results.json"
  job_file.write_text(json.dumps(sorted(jobs.items())))
  proc = subprocess.run(
      [sys.executable, "-c", _CHECKER, str(job_file), str(result_file)],
      cwd=work, env=_env(), capture_output=True, text=True, timeout=600,
      check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(result_file.read_text())
  failures = [f"{script} {' '.join(argv)}\n    {error}"
              for script, argv, error in results if error]
  assert not failures, "documented commands that do not parse:\n" + "\n".join(failures)
  assert len(results) == sum(len(v) for v in jobs.values())


def test_every_run_a_command_reads_is_one_a_command_writes():
  written, read = set(), []
  for where, script, args in app_invocations():
    model_dir = _flag(args, "model_dir")
    if model_dir is None:
      continue
    if script.endswith(WRITERS):
      written.add(os.path.normpath(model_dir))
    elif script.endswith(READERS):
      read.append((where, os.path.normpath(model_dir)))
  missing = [f"{where}: --model_dir={d}" for where, d in read if d not in written]
  assert not missing, ("these commands read a run that no documented "
                       "command writes:\n" + "\n".join(missing))


def test_skipped_commands_are_only_the_known_kinds():
  kinds = [classify(words)[0] for _, words in documented_commands()]
  assert "unknown" not in kinds
  assert kinds.count("app") > 10  # The extraction found the commands.


# --- The README's main job, for real, at a tiny size. -----------------------

_TINY = ["--epochs=0", "--global_batch_size=16", "--steps_per_loop=1",
         "--eval_every=0", "--eval_start_step=0", "--summary_every=1",
         "--log_every=1", "--checkpoint_every=1"]


def _readme_commands():
  by_script = {}
  for where, script, args in app_invocations():
    if where.startswith("README.md:"):
      by_script.setdefault(script, []).append(args)
  return by_script


def _tiny(args, to_root, data_dir):
  out = []
  for arg in _relocate(args, to_root):
    if arg.startswith("--data_dir="):
      arg = "--data_dir=" + data_dir
    out.append(arg)
  return out


def _run(cwd, script, args, to_root):
  # As a user types it: the script's path relative to `cwd`, no PYTHONPATH
  # (the scripts find the framework themselves).
  proc = helpers.run_python(os.path.join(to_root, script), *args, cwd=cwd,
                            env={"PYTHONPATH": None}, timeout=600)
  assert proc.returncode == 0, (
      f"{script} {' '.join(args)} (in {cwd}) exited {proc.returncode}:\n"
      f"{proc.stderr[-4000:]}")
  return proc.stdout + proc.stderr


@pytest.mark.slow
def test_readme_flow_from_other_folders(tmp_path):
  sys.path.insert(0, ROOT)
  from framework.data import datasets  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  data = tmp_path / "data" / "cifar10"
  datasets.write_cifar10(
      str(data), rng.integers(0, 256, (64, 32, 32, 3)), rng.integers(0, 10, 64),
      rng.integers(0, 256, (128, 32, 32, 3)), rng.integers(0, 10, 128))
  work, third = tmp_path / "work", tmp_path / "third"
  work.mkdir()
  third.mkdir()
  commands = _readme_commands()
  (train_args,) = commands["scripts/train.py"]
  (evaluate_args,) = commands["scripts/evaluate.py"]
  (predict_args,) = commands["scripts/predict.py"]
  to_root = os.path.relpath(ROOT, work)
  data_rel = os.path.relpath(data, work)
  train = _tiny(train_args, to_root, data_rel) + _TINY
  model_dir = _flag(train, "model_dir")
  assert not os.path.isabs(model_dir)

  # Train (as if stopped at step 2), then relaunch: it resumes to step 4.
  _run(work, "scripts/train.py", train + ["--train_steps=2"], to_root)
  log = _run(work, "scripts/train.py", train + ["--train_steps=4"], to_root)
  assert re.search(r"Restored checkpoint \S*ckpt-2", log), log[-3000:]
  run_dir = work / model_dir
  assert (run_dir / "ckpt-4.index").exists()
  assert (run_dir / "model.weights.h5").exists()

  log = _run(work, "scripts/evaluate.py",
             _tiny(evaluate_args, to_root, data_rel), to_root)
  assert "accuracy" in log
  log = _run(work, "scripts/predict.py",
             _tiny(predict_args, to_root, data_rel), to_root)
  assert "predicted:" in log

  # The SavedModel the run exported serves a batch of images.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  served = tf.saved_model.load(str(run_dir / "export"))
  out = served.signatures["serving_default"](
      tf.constant(np.zeros([2, 32, 32, 3], np.uint8)))
  assert out["probabilities"].shape == (2, 10)

  # From a third folder, with the run's relative path from there.
  to_root3 = os.path.relpath(ROOT, third)
  rel_run = os.path.relpath(run_dir, third)
  data_rel3 = os.path.relpath(data, third)
  moved = lambda args: [("--model_dir=" + rel_run) if a.startswith("--model_dir=")
                        else a for a in _tiny(args, to_root3, data_rel3)]
  log = _run(third, "scripts/evaluate.py", moved(evaluate_args), to_root3)
  assert "accuracy" in log
  log = _run(third, "scripts/predict.py", moved(predict_args), to_root3)
  assert "predicted:" in log


def test_user_docs_carry_no_issue_numbers_or_dates():
  # Dates and clock times of measurements belong on docs/results/ pages.
  pages = DOCS + sorted(os.path.relpath(p, ROOT) for p in glob.glob(
      os.path.join(ROOT, "docs", "reference", "*.md")))
  found = []
  for page in pages:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
      for number, line in enumerate(f, 1):
        if re.search(r"issue [0-9]|UTC|\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b", line):
          found.append(f"{page}:{number}: {line.strip()}")
  assert not found, "\n".join(found)


def test_relative_links_in_the_docs_reach_a_file():
  pages = ["README.md", "BUILD.md"] + sorted(
      os.path.relpath(p, ROOT) for p in
      glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
  broken = []
  for page in pages:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
      text = f.read()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"^[a-z]+:", target) or target.startswith("#"):
        continue  # A URL or an anchor on the same page.
      path = os.path.normpath(os.path.join(
          ROOT, os.path.dirname(page), target.split("#")[0]))
      if not os.path.exists(path):
        broken.append(f"{page}: {target}")
  assert not broken, "links to missing files:\n" + "\n".join(broken)
