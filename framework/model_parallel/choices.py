"""Model-parallel choices (no TensorFlow: the flags are made from them)."""

MODES = ("none", "pipeline", "tensor")
# Pipeline cut points without explicit boundaries (see `costs`).
BALANCES = ("flops", "params")
# Where the pieces of a split model run (see `devices`).
PLACEMENTS = ("local", "cluster")
