"""What a person reads on the console: the project's own log lines, and durations for ETAs.

Libraries (orbax, TFDS, jax) log a great deal at INFO. By default only the project's INFO lines
and every library's warnings and errors are shown; absl's `--verbosity=1` (or `-v 1`) shows
everything.
"""

from __future__ import annotations

import logging as std_logging
import os

from absl import flags, logging

PROJECT_DIR = os.path.dirname(os.path.abspath(__file__))
# TensorFlow's C++ start-up notices (the input pipeline imports it after this module). TF
# only reads and batches text here, so its oneDNN math kernels, whose notice this is, are unused.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')


class _ProjectInfoOnly(std_logging.Filter):
  """Passes warnings and errors from anywhere, and INFO and below from the project's files."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno >= std_logging.WARNING:
      return True
    if flags.FLAGS.is_parsed() and flags.FLAGS.verbosity >= 1:
      return True
    return os.path.abspath(record.pathname).startswith(PROJECT_DIR + os.sep) and (
        f'{os.sep}site-packages{os.sep}' not in record.pathname)


_FILTER = _ProjectInfoOnly()


def quiet_libraries() -> None:
  """Drops libraries' INFO log lines unless --verbosity >= 1 (idempotent)."""
  handler = logging.get_absl_handler()
  if _FILTER not in handler.filters:
    handler.addFilter(_FILTER)
  if not (flags.FLAGS.is_parsed() and flags.FLAGS.verbosity >= 1):
    import tensorflow_datasets as tfds  # Its progress bars: the pipeline logs its own lines.

    tfds.disable_progress_bar()


def format_duration(seconds: float) -> str:
  """'1h05m', '4m07s'."""
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  return f'{hours}h{rest // 60:02d}m' if hours else f'{rest // 60}m{rest % 60:02d}s'
