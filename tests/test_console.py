"""What a run prints: the project's own lines by default, library INFO lines on request."""

import logging
import os
import pathlib
import subprocess
import sys

import pytest
from absl import flags

from nmt import console

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI30K = os.environ.get('MULTI30K_DIR', '')


def record(path: str, level: int) -> logging.LogRecord:
  return logging.LogRecord('absl', level, path, 1, 'message', None, None)


def test_library_info_is_dropped_unless_verbose(monkeypatch):
  library = os.path.join(REPO, '.venv', 'lib', 'python3.11', 'site-packages', 'orbax', 'x.py')
  other = '/usr/lib/python3/dist-packages/tensorflow_datasets/core.py'
  project = os.path.join(REPO, 'train.py')
  keep = console._FILTER.filter
  assert keep(record(project, logging.INFO))
  assert not keep(record(library, logging.INFO)) and not keep(record(other, logging.INFO))
  assert keep(record(library, logging.WARNING)) and keep(record(other, logging.ERROR))
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  # The flag's value alone: setting FLAGS.verbosity also sets the absl logger's level, and
  # restoring it left that level at WARNING, hiding INFO lines from later tests' caplog.
  monkeypatch.setattr(flags.FLAGS['verbosity'], '_value', 1)
  assert keep(record(library, logging.INFO)) and keep(record(other, logging.DEBUG))


@pytest.mark.skipif(not os.path.isfile(os.path.join(MULTI30K, 'train.en')),
                    reason='needs the Multi30k files: set MULTI30K_DIR')
def test_a_training_run_prints_its_own_lines(tmp_path):
  """Before: 322 of the default run's ~450 lines were orbax internals."""
  result = subprocess.run(
      [sys.executable, 'train.py', '--config', 'configs/tiny.py', '--workdir', str(tmp_path),
       '--config.num_train_steps=10', '--config.eval.every_steps=1000',
       '--config.eval.bleu_sentences=0'], cwd=REPO, capture_output=True, text=True,
      timeout=600, env={**os.environ, 'TRANSFORMER_KEEP_MALLOC': '1'})
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stderr.splitlines()
  info = [line for line in lines if line.startswith('I')]
  project_files = {path.name for folder in ('.', 'nmt', 'model')
                   for path in pathlib.Path(REPO, folder).glob('*.py')}
  assert info and all(any(f' {name}:' in line for name in project_files) for line in info), (
      '\n'.join(info))
  assert any('ETA' in line for line in info) and any('Saving checkpoint' in line for line in info)
  assert any('Done: step 10' in line for line in info)
  assert len(lines) < 40, '\n'.join(lines)


def test_callbacks_onto_a_closed_event_loop_are_dropped_and_other_errors_kept(monkeypatch):
  """Before: reading a damaged checkpoint printed up to ~40 'Event loop is closed' tracebacks
  (tensorstore finishing reads onto orbax's closed loop), burying the one-line error."""
  import asyncio
  import types

  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(print)
  except RuntimeError as error:
    closed = error
  # As tensorstore reports it: called from C++, so asyncio's frames alone.
  asyncio_only = closed.__traceback__.tb_next
  passed_on = []
  monkeypatch.setattr(console, '_ORIGINAL_UNRAISABLEHOOK', passed_on.append)

  def unraisable(error, tb):
    return types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=tb,
                                 err_msg=None, object=None)

  console._drop_closed_loop_callbacks(unraisable(closed, asyncio_only))
  assert passed_on == []
  for kept in (unraisable(closed, closed.__traceback__),  # Raised through other code.
               unraisable(RuntimeError('something else'), asyncio_only)):
    console._drop_closed_loop_callbacks(kept)
  assert len(passed_on) == 2
