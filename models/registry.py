"""Model builders found by name.

A builder is `build(input_shape, num_classes, **options) -> keras.Model` that
returns logits. `build_model` passes each builder only the options its
signature names, so one set of script flags serves every model.
"""

import inspect

from framework.errors import ConfigError

_BUILDERS = {}
_TASKS = {}  # name -> "classification" or "segmentation", where declared
TASKS = ("classification", "segmentation")


def register(name, task=None):
  """Decorator: makes a builder available to `build_model(name, ...)`.

  Args:
    task: "classification" (logits [batch, classes]) or "segmentation"
      (logits [batch, height, width, classes]); lets a run refuse a dataset
      of the other kind before it writes anything. None: not checked
      before the model is built.
  """
  if task is not None and task not in TASKS:
    raise ConfigError(f"task={task!r} is not valid; choose one of: "
                      f"{', '.join(TASKS)}")

  def wrap(builder):
    _BUILDERS[name] = builder
    _TASKS[name] = task
    return builder

  return wrap


def model_names():
  return sorted(_BUILDERS)


def get_builder(name):
  if name not in _BUILDERS:
    raise ConfigError(f"model={name!r} is unknown; known models: "
                      f"{', '.join(model_names())}")
  return _BUILDERS[name]


def check_task(name, per_pixel, dataset, model=None):
  """Raises ConfigError unless model `name` solves the dataset's task.

  Args:
    per_pixel: whether the dataset has one label per pixel (segmentation).
    dataset: the dataset's name, for the message.
    model: the built model, if any: its output rank decides for a model
      registered without a task.
  """
  want = "segmentation" if per_pixel else "classification"
  task = _TASKS.get(name)
  if task is None and model is not None:
    task = "segmentation" if len(model.output_shape) == 4 else "classification"
  if task is None or task == want:
    return
  fitting = [n for n in model_names() if _TASKS.get(n) == want]
  labels = "one class per pixel" if per_pixel else "one class per image"
  raise ConfigError(
      f"model={name!r} is a {task} model but dataset={dataset!r} is a {want} "
      f"task ({labels}); use a {want} model: {', '.join(fitting) or 'none'}")


def build_model(name, input_shape, num_classes, **options):
  """Builds model `name`; options it does not take are ignored."""
  builder = get_builder(name)
  accepted = inspect.signature(builder).parameters
  return builder(tuple(input_shape), num_classes,
                 **{k: v for k, v in options.items() if k in accepted})
