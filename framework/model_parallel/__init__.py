"""Model parallelism: pipeline (layer split) and tensor (unit split)."""

from framework.model_parallel.config import MODES, ModelParallelConfig
from framework.model_parallel.devices import PLACEMENTS, check_cluster, cluster_devices, connect_cluster, model_parallel_devices, short_device, start_cluster, variable_device
from framework.model_parallel.graph import GraphStage, graph_nodes, graph_stages, place_variables, split_graph
from framework.model_parallel.memory import format_memory, memory_by_device, memory_metrics
from framework.model_parallel.placement import misplaced_ops, ops_by_scope
from framework.model_parallel.boundaries import balanced_boundaries
from framework.model_parallel.pipeline import PipelineTrainer, place_sequential, split_layers
from framework.model_parallel.staged_trainer import StagedTrainer, update_scope
from framework.model_parallel.stages import ParallelStage, Stage
from framework.model_parallel.streams import DeviceStreams
from framework.model_parallel.tensor_parallel import ColumnParallelDense, RowParallelDense, TensorParallelModel, TensorParallelTrainer, split_dense_pair

__all__ = [
    "MODES", "PLACEMENTS", "DeviceStreams", "ModelParallelConfig", "GraphStage", "check_cluster",
    "cluster_devices", "connect_cluster", "graph_nodes", "graph_stages",
    "place_variables", "split_graph", "start_cluster", "ColumnParallelDense", "ParallelStage", "PipelineTrainer",
    "RowParallelDense", "Stage", "StagedTrainer", "TensorParallelModel",
    "TensorParallelTrainer", "split_dense_pair",
    "balanced_boundaries", "format_memory", "memory_by_device",
    "memory_metrics", "misplaced_ops", "ops_by_scope", "model_parallel_devices", "place_sequential",
    "short_device", "split_layers", "update_scope", "variable_device",
]
