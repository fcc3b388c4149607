"""The distribution self-check: one step under a strategy against one device.
"""
