"""Where a run executes: strategies, TF_CONFIG, clusters and the launcher.

The lowest layer after `framework.errors`: it imports no other layer.
"""
