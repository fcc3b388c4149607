"""Benchmarks, one per file; `suite.py` runs the CIFAR-10 CNN ones together."""
