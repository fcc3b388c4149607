"""One MirroredStrategy per test process, shared by the in-process tests.

Two MirroredStrategy objects over the same devices in one process can hand
out the same collective instance keys, so the second one's all-reduce fails
with "Shape mismatch in the collective instance"; sharing one avoids it.
"""

import functools

import framework


@functools.lru_cache(maxsize=None)
def mirrored():
  """The process's MirroredStrategy over the logical CPU devices."""
  return framework.make_strategy("mirrored")
