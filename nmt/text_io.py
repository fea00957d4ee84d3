"""Reading text: whole files and pipes (`read_lines`) or lines as they arrive (`stream_lines`),
UTF-8 only, with errors that name the file and line; and the errors bad input data raises.

Lines end at '\n' only (a '\r' before it is dropped) and a UTF-8 byte-order mark at the start
of a file is dropped, so every input line maps to exactly one output line. Standard library
only: export.py copies this file beside serving.py, which reads its input with it.
"""

from __future__ import annotations

import codecs
import os
import select
import sys
from collections.abc import Iterator


class DataError(ValueError):
  """Bad or missing input data; the message says which file/split and what to do."""


class MissingDataError(DataError, FileNotFoundError):
  """A file, folder or split that should exist does not."""


def read_lines(path: str | os.PathLike) -> list[str]:
  """Lines of a UTF-8 text file, pipe or process substitution ('-': stdin) without line
  endings or a leading byte-order mark; errors name file and line."""
  path = os.fspath(path)
  if path == '-':
    path, data = 'stdin', sys.stdin.buffer.read()
  elif os.path.isdir(path):
    raise MissingDataError(f'{path}: is a folder, not a text file.')
  elif not os.path.exists(path):
    raise MissingDataError(f'{path}: file not found.')
  else:
    with open(path, 'rb') as f:
      data = f.read()
  lines = data.split(b'\n')
  if lines and lines[-1] == b'':
    lines.pop()  # Trailing newline of the last line.
  return _text_lines(lines, path, 1)


def _text_lines(lines: list[bytes], name: str, first_line: int) -> list[str]:
  """UTF-8 lines without line endings, the first line of a file (first_line 1) without a
  byte-order mark (Windows editors write one); an error names the file and the line."""
  if first_line == 1 and lines:
    lines = [lines[0].removeprefix(codecs.BOM_UTF8)] + lines[1:]
  try:
    return [line.decode('utf-8').rstrip('\r') for line in lines]
  except UnicodeDecodeError as e:
    line = first_line + next(i for i, x in enumerate(lines) if not _is_utf8(x))
    raise DataError(f'{name}:{line}: invalid UTF-8 ({e.reason}); convert the file to UTF-8, '
                    'e.g. `iconv -f LATIN1 -t UTF-8`.') from None


def _is_utf8(data: bytes) -> bool:
  try:
    data.decode('utf-8')
    return True
  except UnicodeDecodeError:
    return False


def stream_lines(fd: int, max_lines: int = 1024, name: str = 'stdin') -> Iterator[list[str]]:
  """Lines of a pipe, terminal or file as they arrive, for interactive translation.

  Each chunk holds at least one line: it waits for the first, then takes the complete lines
  already readable without waiting (at most `max_lines`). A last line without a newline
  counts. Errors name the line, as `read_lines`.
  """
  pending, line_number, ended = b'', 1, False
  while not ended:
    lines: list[bytes] = []
    while len(lines) < max_lines:
      if lines and not select.select([fd], [], [], 0)[0]:
        break  # Nothing more right now: translate what has arrived.
      data = os.read(fd, 1 << 16)
      if not data:
        ended = True
        if pending:
          lines.append(pending)
        break
      *complete, pending = (pending + data).split(b'\n')
      lines.extend(complete)
    if lines:
      yield _text_lines(lines, name, line_number)
      line_number += len(lines)
