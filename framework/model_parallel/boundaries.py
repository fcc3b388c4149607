"""Where a pipeline is cut: stage boundaries checked, or balanced by cost."""

from framework.errors import ConfigError


def balanced_boundaries(sizes, num_stages):
  """Cut points that minimise the largest stage's total of `sizes`.

  Args:
    sizes: per-layer cost (parameter counts), in order.
    num_stages: how many contiguous, non-empty stages.
  Returns:
    A tuple of `num_stages - 1` increasing indices: stage i is
    `layers[bounds[i-1]:bounds[i]]`.
  """
  n = len(sizes)
  prefix = [0]
  for size in sizes:
    prefix.append(prefix[-1] + size)
  # best[k][j]: (largest stage, cuts) for the first j layers in k stages.
  inf = (float("inf"), ())
  best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
  best[0][0] = (0, ())
  for k in range(1, num_stages + 1):
    for j in range(k, n + 1):
      for i in range(k - 1, j):
        worst, cuts = best[k - 1][i]
        candidate = (max(worst, prefix[j] - prefix[i]), cuts + (i,))
        if candidate[0] < best[k][j][0]:
          best[k][j] = candidate
  return best[num_stages][n][1][1:]


def check_boundaries(boundaries, num_layers, num_stages):
  """Raises ConfigError unless `boundaries` cut `num_layers` into stages."""
  boundaries = tuple(boundaries)
  valid = (len(boundaries) == num_stages - 1 and
           all(isinstance(b, int) for b in boundaries) and
           all(0 < b < num_layers for b in boundaries) and
           list(boundaries) == sorted(set(boundaries)))
  if not valid:
    raise ConfigError(
        f"stage_boundaries={list(boundaries)} must be {num_stages - 1} "
        f"strictly increasing layer indices in 1..{num_layers - 1} (cut "
        f"points between the {num_layers} layers)")
  return boundaries
