"""Model parallelism: pipeline (layer split) and tensor (unit split).

Names are imported on first use (PEP 562): `ModelParallelConfig` loads
without TensorFlow (the flags are made from it), and a run that splits
nothing loads no trainer, device or layer module.
"""

import importlib
import importlib.util

_EXPORTS = {
    "framework.model_parallel.config": [
        "MODES", "PLACEMENTS", "ModelParallelConfig",
    ],
    "framework.model_parallel.devices": [
        "DeviceStreams", "check_cluster", "cluster_devices", "connect_cluster",
        "format_memory", "memory_by_device", "memory_metrics",
        "misplaced_ops", "model_parallel_devices", "ops_by_scope",
        "short_device", "start_cluster", "variable_device",
    ],
    "framework.model_parallel.pipeline": [
        "GraphStage", "PipelineTrainer", "balanced_boundaries", "graph_nodes",
        "graph_stages", "place_sequential", "place_variables", "split_graph",
        "split_layers",
    ],
    "framework.model_parallel.staged_trainer": [
        "ParallelStage", "Stage", "StagedTrainer", "update_scope",
    ],
    "framework.model_parallel.tensor_parallel": [
        "ColumnParallelDense", "RowParallelDense", "TensorParallelModel",
        "TensorParallelTrainer", "split_dense_pair", "trainer_factory",
    ],
}
_WHERE = {name: module for module, names in _EXPORTS.items()
          for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name):
  if name in _WHERE:
    value = getattr(importlib.import_module(_WHERE[name]), name)
  elif importlib.util.find_spec(f"{__name__}.{name}"):
    value = importlib.import_module(f"{__name__}.{name}")  # a submodule
  else:
    raise AttributeError(
        f"module 'framework.model_parallel' has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
