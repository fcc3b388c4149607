"""Input: in-memory datasets, TFRecord shards, image folders, and the
tf.data pipelines that distribute them.
"""
