"""Where a task's cluster comes from: `train.py`'s cluster flags as one
frozen dataclass (no TensorFlow: the flags read their defaults from it)."""

import dataclasses

from framework.errors import ConfigError, check_choice

CLUSTER_RESOLVERS = ("tf_config", "slurm")


@dataclasses.dataclass(frozen=True)
class ClusterOptions:
  """Where a task's cluster comes from and how long it may take to start.

  Attributes:
    resolver: `tf_config` (the TF_CONFIG variable) or `slurm` (srun's
      variables through SlurmClusterResolver).
    slurm_ps_tasks: `slurm`: ps tasks (task 0 is then the chief).
    slurm_port_base: `slurm`: the first gRPC port on each node.
    startup_timeout: seconds for every task of a multi-worker or
      parameter-server cluster to start before the run exits naming the
      missing ones (0: wait forever).
  """
  resolver: str = "tf_config"
  slurm_ps_tasks: int = 0
  slurm_port_base: int = 8888
  startup_timeout: float = 120

  def __post_init__(self):
    check_choice("cluster_resolver", self.resolver, CLUSTER_RESOLVERS)
    if self.slurm_ps_tasks < 0:
      raise ConfigError(f"slurm_ps_tasks={self.slurm_ps_tasks} must be >= 0")
    if self.startup_timeout is None or self.startup_timeout < 0:
      raise ConfigError(f"startup_timeout={self.startup_timeout} must be "
                        ">= 0")
