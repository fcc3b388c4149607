"""Progress lines (absl INFO) visible from a plain Python process.

Under an absl app (`scripts/train.py`), `--verbosity`/`--logtostderr`
decide. From a plain `python` process absl shows only warnings, so the
Controller's progress lines (`train step ...`, `eval step ...`) would be
silent: `Controller.run()` turns INFO on there, once, unless the user
configured logging (absl's verbosity, or a handler on the root logger).
`enable_logging()` does it explicitly, at any level.
"""

import logging as std_logging
from typing import Union

from absl import flags
from absl import logging

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO,
           "warning": logging.WARNING, "error": logging.ERROR}


def enable_logging(level: Union[str, int] = "info") -> None:
  """Shows distloop's (absl) log lines at `level` and above on stderr."""
  if isinstance(level, str):
    if level.lower() not in _LEVELS:
      from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
      raise ConfigError(f"level={level!r} must be one of "
                        f"{', '.join(_LEVELS)} (or an absl level number)")
    level = _LEVELS[level.lower()]
  logging.set_verbosity(level)


def user_configured_logging() -> bool:
  """Whether someone chose how logs show: an absl app's flags, absl's
  verbosity, or Python logging's root handlers or level."""
  root = std_logging.getLogger()
  return (flags.FLAGS.is_parsed()
          or logging.get_absl_logger().level != std_logging.NOTSET
          or any(not isinstance(h, logging.ABSLHandler)
                 for h in root.handlers)
          or root.level != std_logging.WARNING)


def show_progress_by_default() -> None:
  """INFO from a plain Python process where nobody configured logging."""
  if not user_configured_logging():
    enable_logging("info")
