"""AutoGraph's conversions of the framework's graph code, done once in the
test zygote (tests/zygote.py) so that every run forked from it inherits
them.

A `tf.function` converts each Python function it reaches with AutoGraph
(parse the source, rewrite the AST, compile it): ~4 s of a 8 s MLP run of
train.py after its imports, the same in every run. AutoGraph caches each
conversion by the function's code object and the conversion options, so a
conversion done in the zygote is a cache hit in each forked child; the
converted code is the same as the child would have made.

The zygote converts CORE_MODULES' functions before it serves its first
request (`convert_core`: every train.py run needs them, and the first
runs would otherwise each convert them again while the zygote is at it),
then the rest in its idle time, one function at a time (`step`), most
used modules first, so a run's request waits for one conversion at most.
It needs nothing of TensorFlow's runtime (no eager context, no
threads), so forking stays safe. Everything here is best effort: another
TensorFlow whose AutoGraph internals differ gets no warm-up, not an error.
"""

import atexit
import importlib
import inspect
import os
import pkgutil

# Modules whose functions run inside tf.function or tf.data graphs, most
# used first. A package name stands for all of its modules. CORE_MODULES:
# what every train.py run of the Trainer converts.
CORE_MODULES = (
    "framework.core.trainer", "framework.core.trainer",
    "framework.core.gradients", "framework.core.updates",
    "framework.core.evaluation",
    "framework.core.trainer", "framework.core.optimizers",
    "framework._tf_internal", "framework.data.inputs", "framework.app.export",
    "framework.core.gradients", "framework.core.evaluation")
_MODULES = CORE_MODULES + (
    "framework.core.trainer", "framework.core.precision", "framework.core.optimizers",
    "framework.core.optimizer_sharding",
    "framework.core.optimizers", "framework.core.summaries",
    "framework.tasks", "framework.data.preprocessing", "framework.model_parallel",
    "framework.core.ps_training", "framework.data.file_input",
    "framework.data.tfrecords", "framework.data.image_folder",
    "framework.data.tfds_input", "framework.check", "framework.perf.flops")
# Modules that hold the functions a tf.function wraps (converted with
# user_requested=True; what they call is converted without).
_ENTRY_MODULES = ("framework.core.trainer", "framework.core.trainer",
                  "framework.core.evaluation", "framework.app.export",
                  "framework.core.ps_training",
                  "framework.model_parallel.staged_trainer",
                  "framework.model_parallel.tensor_parallel",
                  "framework.check.distribution_check",
                  "framework.check.distribution_step")


class Warmup:
  """The conversions still to do; `step()` does the next one."""

  def __init__(self, modules=_MODULES):
    self._pending = []
    self._core = 0  # the first of them: CORE_MODULES'
    try:
      from tensorflow.python.autograph.core import converter  # pylint: disable=g-import-not-at-top
      from tensorflow.python.autograph.impl import api  # pylint: disable=g-import-not-at-top
      self._convert = api._convert_actual  # pylint: disable=protected-access
      # What tf.function uses (autograph_util.py) and what a converted
      # function uses for the functions it calls (`call_options`).
      entry = converter.ConversionOptions(
          recursive=True, user_requested=True, optional_features=None)
      nested = entry.call_options()
      contexts = {
          True: converter.ProgramContext(options=entry),
          False: converter.ProgramContext(options=nested)}
    except (ImportError, AttributeError, TypeError):
      return
    seen = set()
    for module in _modules(modules):
      entry_module = module.__name__ in _ENTRY_MODULES
      for function in _functions(module):
        if function.__code__ in seen:
          continue
        seen.add(function.__code__)
        self._pending.append((function, contexts[False]))
        if entry_module:
          self._pending.append((function, contexts[True]))
      if module.__name__ in CORE_MODULES:  # they come first
        self._core = len(self._pending)
    self._pending.reverse()  # pop() from the end: most used first
    # AutoGraph deletes its generated files at exit (atexit). A forked run
    # runs the zygote's exit handlers too: only the zygote may delete the
    # files of the conversions it made.
    self._removals = []
    self._pid = os.getpid()
    atexit.register(self._remove_files)

  @property
  def pending(self):
    return len(self._pending)

  def convert_core(self):
    """Does CORE_MODULES' conversions now: the first runs forked would
    otherwise each convert them again while the zygote is still at it."""
    while self._core > 0 and self._pending:
      self._core -= 1
      self.step()

  def step(self):
    """Converts the next function; returns whether any are left."""
    if not self._pending:
      return False
    function, context = self._pending.pop()
    register = atexit.register
    atexit.register = lambda fn, *a, **k: self._removals.append((fn, a, k))
    try:
      self._convert(function, context)
    except Exception:  # pylint: disable=broad-except
      pass  # Not convertible (a child converting it would fail the same).
    finally:
      atexit.register = register
    return bool(self._pending)

  def _remove_files(self):
    if os.getpid() == self._pid:
      for fn, args, kwargs in self._removals:
        fn(*args, **kwargs)


def _modules(names):
  """The modules `names` (packages expanded), each once, in order."""
  done = set()
  for name in names:
    try:
      module = importlib.import_module(name)
    except Exception:  # pylint: disable=broad-except
      continue
    found = [module]
    if hasattr(module, "__path__"):
      for info in pkgutil.walk_packages(module.__path__, name + "."):
        try:
          found.append(importlib.import_module(info.name))
        except Exception:  # pylint: disable=broad-except
          pass
    for each in found:
      if each.__name__ not in done:
        done.add(each.__name__)
        yield each


def _functions(module):
  """The functions and methods defined in `module` (not imported into it)."""
  for value in vars(module).values():
    if inspect.isfunction(value) and value.__module__ == module.__name__:
      yield value
    elif inspect.isclass(value) and value.__module__ == module.__name__:
      for member in vars(value).values():
        if isinstance(member, (staticmethod, classmethod)):
          member = member.__func__
        if inspect.isfunction(member):
          yield member
