"""`--mesh=data:2,model:2`: one device mesh for every split (no TensorFlow).

Axes: `data` (copies of the model, each on its own devices, gradients
all-reduced across them), `model` (tensor parallelism: the devices one
copy's layers are cut across) and `pipeline` (stages). The product of the
sizes is the number of devices the run uses. `--model_parallel=tensor
--num_shards=S` is the one-axis mesh `model:S`, `--model_parallel=pipeline
--num_stages=S` is `pipeline:S`, and `--strategy=mirrored` with R * S
devices adds `data:R`.
"""

from framework.errors import ConfigError

AXES = ("data", "model", "pipeline")


def parse_mesh(text):
  """`"data:2,model:2"` -> {"data": 2, "model": 2} (every axis named once).

  Raises:
    ConfigError: an unknown axis, a size that is not a positive integer,
      an axis named twice, or no model or pipeline axis > 1.
  """
  sizes = {}
  for part in str(text).split(","):
    name, colon, size = part.strip().partition(":")
    if not colon or not name:
      raise ConfigError(f"mesh={text!r}: {part.strip()!r} must be axis:size, "
                        "e.g. --mesh=data:2,model:2")
    if name not in AXES:
      raise ConfigError(f"mesh={text!r}: unknown axis {name!r}; the axes "
                        f"are {', '.join(AXES)}")
    if name in sizes:
      raise ConfigError(f"mesh={text!r} names the axis {name!r} twice")
    if not size.strip().isdigit() or int(size) < 1:
      raise ConfigError(f"mesh={text!r}: the size of {name!r} must be a "
                        f"positive integer, got {size!r}")
    sizes[name] = int(size)
  if sizes.get("model", 1) == 1 and sizes.get("pipeline", 1) == 1:
    raise ConfigError(f"mesh={text!r} splits no model (a model or pipeline "
                      "axis > 1); data parallelism alone is "
                      "--strategy=mirrored")
  return sizes


def mesh_size(sizes):
  """The number of devices of a parsed mesh."""
  total = 1
  for size in sizes.values():
    total *= size
  return total


def check_device_count(text, sizes, gpus, cpus):
  """Raises ConfigError unless the mesh's devices are exactly the local
  devices it runs on (the GPUs when there are enough, else the logical
  CPUs)."""
  total = mesh_size(sizes)
  available = gpus if gpus >= total else cpus
  kind = "GPU(s)" if gpus >= total else "logical CPU device(s)"
  if available != total:
    raise ConfigError(
        f"mesh={text} has {total} devices (the product of its axes) but "
        f"this process has {available} {kind}; make them equal (e.g. "
        f"--cpu_devices={total}) or change the mesh")
