"""The strategy names a run chooses from (no TensorFlow: flags use them)."""

STRATEGIES = ("default", "one_device", "mirrored", "multi_worker_mirrored",
              "central_storage", "parameter_server", "tpu")
# What an evaluation may run under: every strategy but parameter_server
# (its workers serve a coordinator; evaluation runs in one process).
EVAL_STRATEGIES = tuple(s for s in STRATEGIES if s != "parameter_server")
