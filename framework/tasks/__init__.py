"""Task-specific trainers and metrics (confusion matrices, segmentation).
"""
