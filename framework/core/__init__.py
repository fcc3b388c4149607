"""The loop: Trainer (one step's math), Controller (the outer loop),
checkpoints, summaries, optimizers, precision, preemption and the
parameter-server stepping.
"""
