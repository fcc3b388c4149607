"""Model parallelism: pipeline (layer split) and tensor (unit split).

Names are imported on first use (PEP 562), so that `ModelParallelConfig`
loads without TensorFlow (the flags are made from it).
"""

import importlib
import importlib.util

_EXPORTS = {
    "framework.model_parallel.choices": ["MODES", "PLACEMENTS"],
    "framework.model_parallel.config": ["ModelParallelConfig"],
    "framework.model_parallel.devices": [
        "check_cluster", "cluster_devices", "connect_cluster",
        "model_parallel_devices", "short_device", "start_cluster",
        "variable_device",
    ],
    "framework.model_parallel.graph": [
        "GraphStage", "graph_nodes", "graph_stages", "place_variables",
        "split_graph",
    ],
    "framework.model_parallel.memory": [
        "format_memory", "memory_by_device", "memory_metrics",
    ],
    "framework.model_parallel.placement": ["misplaced_ops", "ops_by_scope"],
    "framework.model_parallel.boundaries": ["balanced_boundaries"],
    "framework.model_parallel.pipeline": [
        "PipelineTrainer", "place_sequential", "split_layers",
    ],
    "framework.model_parallel.staged_trainer": [
        "StagedTrainer", "update_scope",
    ],
    "framework.model_parallel.stages": ["ParallelStage", "Stage"],
    "framework.model_parallel.streams": ["DeviceStreams"],
    "framework.model_parallel.dense_pair": [
        "ColumnParallelDense", "RowParallelDense", "TensorParallelModel",
        "split_dense_pair",
    ],
    "framework.model_parallel.tensor_parallel": ["TensorParallelTrainer"],
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
