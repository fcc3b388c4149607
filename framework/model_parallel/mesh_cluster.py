"""A mesh over the tasks of a cluster: its data axis across processes.

    scripts/launch.py --workers=2 -- python scripts/train.py --model=gpt \\
        --mesh=data:2,model:2 --model_parallel_devices=cluster --cpu_devices=2

      worker 0  /job:worker/task:0/CPU:0  /CPU:1    copy 0 (checkpointed)
      worker 1  /job:worker/task:1/CPU:0  /CPU:1    copy 1
      chief     the training loop, the input, the checkpoints (launch.py
                adds it; it holds no variable)

Copy r of the split lives on worker task r, one process: the tensor
split's all-reduces (the model axis, two per block and step) never leave
it, and only the gradient all-reduce (the data axis: shard d of copy 0
with shard d of copy 1) crosses processes, once per step. The other way
round (a copy's shards on different tasks) would send every block's
activations over the network twice per pass. Each worker task offers the
devices of one copy: `--cpu_devices` of them (its gRPC server's CPU
devices), or its GPUs.

The chief drives every task from one program (TensorFlow's distributed
runtime, as for the other `cluster` splits); the all-reduces are
TensorFlow's collectives over the remote devices.
"""

from framework.errors import ConfigError


def worker_count(sizes):
  """Worker tasks a parsed mesh needs on a cluster: its data axis."""
  return sizes.get("data", 1)


def devices_per_task(sizes):
  """Devices of one copy (every axis but data): one worker task's."""
  count = 1
  for axis, size in sizes.items():
    if axis != "data":
      count *= size
  return count


def _index(name):
  return int(name.rsplit(":", 1)[1])


def task_devices(names, task):
  """{"GPU": [...], "CPU": [...]}: worker `task`'s devices in `names`
  (the chief's `tf.config.list_logical_devices()` names), by index."""
  prefix = f"/job:worker/replica:0/task:{task}/device:"
  found = {"GPU": [], "CPU": []}
  for name in names:
    kind = name[len(prefix):].split(":")[0] if name.startswith(prefix) else ""
    if kind in found:
      found[kind].append(name)
  return {kind: sorted(found[kind], key=_index) for kind in found}


def cluster_groups(text, sizes, names):
  """R lists of a copy's devices, list r on worker task r.

  Each task's first GPUs when it has enough of them, else its CPUs.

  Args:
    text: the `--mesh` value (named in errors).
    sizes: the parsed mesh.
    names: the device names the chief sees once connected.
  Raises:
    ConfigError: a worker task with too few devices for one copy.
  """
  count = devices_per_task(sizes)
  groups = []
  for task in range(worker_count(sizes)):
    devices = task_devices(names, task)
    kind = "GPU" if len(devices["GPU"]) >= count else "CPU"
    if len(devices[kind]) < count:
      raise ConfigError(
          f"mesh={text} on a cluster puts one copy of the split on each "
          f"worker task: {count} devices (the axes other than data) each; "
          f"worker {task} has {len(devices['CPU'])} CPU device(s) and "
          f"{len(devices['GPU'])} GPU(s); start the tasks with "
          f"--cpu_devices={count}")
    groups.append(devices[kind][:count])
  return groups
