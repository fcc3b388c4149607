"""Runs from a config: the settings (config), a run's plan, its build
(factory) and the run path (experiment), export, evaluation, prediction.
"""
