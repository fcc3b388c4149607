"""Runs from a config: experiment (train), export, evaluation, prediction.
"""
