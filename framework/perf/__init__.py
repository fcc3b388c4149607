"""Measuring: FLOP counts and the profiler window.
"""
