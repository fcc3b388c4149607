"""`framework.app.experiment.run_task`, what train.py runs after its flags: Slurm's
variables become TF_CONFIG, parameter-server `ps` and `worker` tasks only
serve, a one-process run trains under the preemption guard and logs its
weights' digest; `ClusterOptions` checks its fields."""

import json
import logging

import pytest

from framework.app import experiment
from framework.core import actions
from framework.distribute import cluster
from framework.distribute.config import ClusterOptions
from framework.errors import ConfigError
from tests.helpers import tiny_mlp_config


_config = tiny_mlp_config


def _slurm(monkeypatch, procid):
  """Task `procid` of 4 Slurm tasks, two per node, as srun sets them."""
  monkeypatch.setenv("SLURM_PROCID", str(procid))
  monkeypatch.setenv("SLURM_STEP_NODELIST", "node[01-02]")
  monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
  monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
  monkeypatch.setattr(cluster.shutil, "which", lambda name: None)


@pytest.mark.parametrize("procid,role", [(1, "ps"), (2, "worker")])
def test_a_slurm_parameter_server_task_serves_and_trains_nothing(
    tmp_path, monkeypatch, procid, role):
  _slurm(monkeypatch, procid)
  # run_task writes both into os.environ: set (then unset) through
  # monkeypatch so that they are removed again after the test (a delenv of
  # an absent name records nothing to undo, and TF_CONFIG would leak into
  # the next test of this process).
  for name in ("TF_CONFIG", "GRPC_FAIL_FAST"):
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)
  served = []
  monkeypatch.setattr(cluster, "run_server", served.append)
  monkeypatch.setattr(experiment, "run", lambda *a, **k: pytest.fail(
      "a serving task must not train"))
  result = experiment.run_task(
      _config(tmp_path / "run", strategy="parameter_server"),
      options=ClusterOptions(resolver="slurm", slurm_ps_tasks=1,
                             slurm_port_base=9000))
  assert result is None
  tf_config = json.loads(experiment.os.environ["TF_CONFIG"])
  assert sorted(tf_config["cluster"]) == ["chief", "ps", "worker"]
  assert tf_config["cluster"]["chief"] == ["node01:9000"]
  assert served == [tf_config] and tf_config["task"]["type"] == role
  assert experiment.os.environ["GRPC_FAIL_FAST"] == "use_caller"
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_one_process_trains_preemptible_and_logs_its_weights_digest(
    tmp_path, caplog, monkeypatch):
  caplog.set_level(logging.INFO)
  # Recorded, not installed: the handlers would outlive the test in pytest.
  guarded, installed = [], []
  monkeypatch.setattr(actions, "guard_start", guarded.append)
  monkeypatch.setattr(actions, "install", installed.append)
  results = experiment.run_task(_config(tmp_path / "run"), program="train.py")
  assert set(results) >= {"loss", "accuracy", "examples"}
  assert guarded == ["train.py"]
  assert len(installed) == 1 and installed[0].step == 2
  digests = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("final weights sha256=")]
  assert len(digests) == 1 and len(digests[0].split("=")[1]) == 16


@pytest.mark.parametrize("field,value,message", [
    ("resolver", "k8s", "cluster_resolver='k8s'"),
    ("slurm_ps_tasks", -1, "slurm_ps_tasks=-1 must be >= 0"),
    ("startup_timeout", -2, "startup_timeout=-2 must be >= 0")])
def test_cluster_options_name_a_bad_field(field, value, message):
  with pytest.raises(ConfigError, match=message):
    ClusterOptions(**{field: value})
