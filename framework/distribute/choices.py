"""The strategy names a run chooses from (no TensorFlow: flags use them)."""

STRATEGIES = ("default", "one_device", "mirrored", "multi_worker_mirrored",
              "central_storage", "parameter_server", "tpu")
