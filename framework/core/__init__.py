"""The loop: Trainer (one step's math), Controller (the outer loop), the
protocols between them, evaluation, actions, checkpoints (a package),
summaries, optimizers and ZeRO-1, precision and the parameter-server
stepping.
"""
