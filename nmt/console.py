"""What a person reads on the console: the project's own log lines, and durations for ETAs.

Libraries (orbax, TFDS, jax) log a great deal at INFO. By default only the project's INFO lines
and every library's warnings and errors are shown, except TFDS's notices about the pipeline's
fingerprinted builders and the library errors about a full disk (orbax logs each writer thread's
traceback; the run reports it in one line, see `is_out_of_space`) and tensorstore's callbacks
that land on orbax's closed event loop after a failed read or write; absl's `--verbosity=1` (or
`-v 1`) shows everything.
"""

from __future__ import annotations

import errno
import logging as std_logging
import os
import sys

from absl import flags, logging

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# TensorFlow's C++ start-up notices (clu's TensorBoard writer and TFDS's preparation of large
# datasets import it). TF only writes files here, so its oneDNN math kernels, whose notice
# this is, are unused.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')


# TFDS warnings about what the input pipeline does on purpose: builders named by a fingerprint
# of their files (nmt.data_sources.ParallelTextFolder, Multi30k's local copy).
_EXPECTED_LIBRARY_WARNINGS = ('Using custom data configuration', 'has no dataset_info.json')
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_NO_SPACE_TEXTS = ('No space left on device', 'Disk quota exceeded', 'File too large')
_LOST_PEER_TEXTS = ('Connection closed by peer', 'Connection reset by peer')


def is_out_of_space(error: BaseException | None) -> bool:
  """Whether a write failed for lack of room (full disk, quota, file size limit), however
  deep orbax or tensorstore wrapped the OSError."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in _NO_SPACE_ERRNOS:
      return True
    if any(text in str(error) for text in _NO_SPACE_TEXTS):
      return True
    error = error.__cause__ or error.__context__
  return False


def is_lost_peer(error: BaseException) -> bool:
  """Whether a collective failed because a peer process went away mid-step (gloo, the CPUs'
  collectives, says so in its error; otherwise the coordination service's heartbeat notices,
  by aborting the process)."""
  return any(text in str(error) for text in _LOST_PEER_TEXTS)


def _from_project(record: std_logging.LogRecord) -> bool:
  return os.path.abspath(record.pathname).startswith(PROJECT_DIR + os.sep) and (
      f'{os.sep}site-packages{os.sep}' not in record.pathname)


class _ProjectInfoOnly(std_logging.Filter):
  """Passes warnings and errors from anywhere (but libraries' full-disk errors), and INFO and
  below from the project's files."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if flags.FLAGS.is_parsed() and flags.FLAGS.verbosity >= 1:
      return True
    if record.levelno >= std_logging.WARNING:
      if _from_project(record):
        return True
      text = record.getMessage()
      if record.exc_info and record.exc_info[1] is not None:
        return not is_out_of_space(record.exc_info[1])
      return not any(t in text for t in _NO_SPACE_TEXTS + _EXPECTED_LIBRARY_WARNINGS)
    return _from_project(record)


_FILTER = _ProjectInfoOnly()


def _drop_closed_loop_callbacks(unraisable) -> None:
  """sys.unraisablehook without one kind of noise: when orbax stops reading or writing a
  checkpoint early (damaged files, a full disk), tensorstore completes the reads and writes
  still in flight onto orbax's closed event loop, and each raises 'Event loop is closed' in
  asyncio's own frames, with nothing for the user to do."""
  error, tb = unraisable.exc_value, unraisable.exc_traceback
  if isinstance(error, RuntimeError) and str(error) == 'Event loop is closed':
    frames = []
    while tb is not None:
      frames.append(tb.tb_frame.f_code.co_filename)
      tb = tb.tb_next
    if all(f'{os.sep}asyncio{os.sep}' in frame for frame in frames):
      return
  _ORIGINAL_UNRAISABLEHOOK(unraisable)


_ORIGINAL_UNRAISABLEHOOK = sys.unraisablehook


def quiet_libraries() -> None:
  """Drops libraries' INFO log lines and known noise unless --verbosity >= 1 (idempotent)."""
  handler = logging.get_absl_handler()
  if _FILTER not in handler.filters:
    handler.addFilter(_FILTER)
  if not (flags.FLAGS.is_parsed() and flags.FLAGS.verbosity >= 1):
    sys.unraisablehook = _drop_closed_loop_callbacks
  if not (flags.FLAGS.is_parsed() and flags.FLAGS.verbosity >= 1):
    import tensorflow_datasets as tfds  # Its progress bars: the pipeline logs its own lines.

    tfds.disable_progress_bar()


def format_duration(seconds: float) -> str:
  """'1h05m', '4m07s'."""
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  return f'{hours}h{rest // 60:02d}m' if hours else f'{rest // 60}m{rest % 60:02d}s'
