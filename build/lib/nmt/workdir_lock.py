"""One trainer per workdir: a lock file, `WORKDIR/train.lock`, held while train.py runs.

Two trainers on one workdir would delete each other's in-progress checkpoint saves, overwrite
checkpoints, interleave metrics.jsonl and rewrite config.json. The trainer takes the lock before
it touches the workdir; a second one stops with `WorkdirLockedError`, one line that says who
holds the lock and what to do.

The lock file is JSON: host name, pid, the process's start time (so a reused pid is not taken
for the holder), creation time, a heartbeat time a daemon thread rewrites while the lock is
held, and a token unique to this hold. It appears atomically, complete (a temporary file
hard-linked to its name, which fails if the name exists), so of two starters exactly one wins.

A stale lock is taken over with a warning: on the same host, when its pid is not running or
now belongs to another process; from another host, where the pid cannot be checked, when its
heartbeat is older than `STALE_AFTER_SECONDS`. Takers of one stale lock first create a claim
file named by its token (exclusively), so only one of them removes it, and only if the lock
file still holds that token. On several hosts, process 0 takes the lock and every process
learns the outcome, so all of them stop together.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from absl import logging

LOCK_NAME = 'train.lock'
HEARTBEAT_SECONDS = 60.0
# Another host's lock whose heartbeat is older than this is stale (its pid cannot be checked).
STALE_AFTER_SECONDS = 600.0
# A claim file this old belongs to a taker that died mid-takeover.
CLAIM_STALE_SECONDS = 60.0
_ATTEMPTS = 50
_RETRY_SECONDS = 0.02
# link() errors of filesystems without hard links: there the lock is created with O_EXCL.
_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV)


class WorkdirLockedError(RuntimeError):
  """Another trainer holds the workdir's lock; the message (one line) says who and what to do."""


def process_start_time(pid: int) -> int | None:
  """The process's start time in clock ticks after boot (/proc/PID/stat field 22), or None."""
  try:
    with open(f'/proc/{pid}/stat', encoding='utf-8') as f:
      stat = f.read()
  except OSError:
    return None
  # Field 2, the command name, may hold spaces and parentheses: count from its closing one.
  fields = stat[stat.rfind(')') + 2:].split()
  try:
    return int(fields[22 - 3])
  except (IndexError, ValueError):
    return None


def _pid_running(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Another user's process.
    return True
  return True


def _well_formed(holder: Any) -> bool:
  return (isinstance(holder, dict) and isinstance(holder.get('host'), str)
          and isinstance(holder.get('pid'), int) and holder['pid'] > 0
          and isinstance(holder.get('token'), str)
          and all(isinstance(holder.get(key), int | float) for key in ('created', 'heartbeat')))


def _format_time(seconds: float) -> str:
  return time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(seconds))


def describe(holder: dict[str, Any]) -> str:
  """'pid 123 on host h (since 2024-01-02 03:04:05)'."""
  return (f'pid {holder.get("pid")} on host {holder.get("host")} '
          f'(since {_format_time(float(holder.get("created", 0)))})')


def stale_reason(holder: dict[str, Any], stale_after: float = STALE_AFTER_SECONDS,
                 now: float | None = None) -> str | None:
  """Why the lock `holder` is stale, or None while its trainer may still run."""
  if holder['host'] == socket.gethostname():
    pid = holder['pid']
    if not _pid_running(pid):
      return f'pid {pid} is not running'
    start_time = process_start_time(pid)
    if None not in (start_time, holder.get('start_time')) and start_time != holder['start_time']:
      return f'pid {pid} now belongs to another process'
    return None
  age = (time.time() if now is None else now) - holder['heartbeat']
  if age > stale_after:
    return f'its heartbeat is {age:.0f} s old (host {holder["host"]} cannot be checked from here)'
  return None


class WorkdirLock:
  """`with WorkdirLock(workdir):` holds WORKDIR/train.lock, or raises WorkdirLockedError."""

  def __init__(self, workdir: str, heartbeat_seconds: float = HEARTBEAT_SECONDS,
               stale_after: float = STALE_AFTER_SECONDS):
    self.workdir = workdir
    self.path = os.path.join(os.path.abspath(workdir), LOCK_NAME)
    self.heartbeat_seconds = heartbeat_seconds
    self.stale_after = stale_after
    self._content: dict[str, Any] | None = None  # Set while this object holds the lock.
    self._stop = threading.Event()
    self._heartbeat: threading.Thread | None = None

  def __enter__(self) -> WorkdirLock:
    return self.acquire()

  def __exit__(self, *exc_info) -> None:
    self.release()

  @property
  def held(self) -> bool:
    return self._content is not None

  def acquire(self) -> WorkdirLock:
    """Takes the lock (on process 0 of a multi-host run) or raises WorkdirLockedError."""
    jax = sys.modules.get('jax')  # A multi-host run has imported jax (jax.distributed) by now.
    if jax is None or jax.process_count() == 1:
      self._acquire_here()
      return self
    import numpy as np
    from jax.experimental import multihost_utils

    error = None
    if jax.process_index() == 0:
      try:
        self._acquire_here()
      except Exception as e:  # Every process learns of it below; process 0 raises it.
        error = e
    took = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
    if error is not None:
      raise error
    if not took:
      raise WorkdirLockedError(
          f'{self.workdir} is in use: process 0 could not take {self.path} (its error names '
          'the holder); wait for that trainer to finish, use another --workdir, or, if you are '
          f'sure no trainer runs there, delete {self.path}.')
    return self

  def release(self) -> None:
    """Stops the heartbeat and removes the lock file if it is still ours; idempotent."""
    if self._content is None:
      return
    self._stop.set()
    if self._heartbeat is not None:
      self._heartbeat.join()
    if self._is_ours(self._read()):
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass
    self._content = None

  # ----------------------------------------------------------------------- taking the lock

  def _acquire_here(self) -> None:
    if self._content is not None:
      raise RuntimeError(f'{self.path} is already held by this WorkdirLock.')
    now = time.time()
    content = {'host': socket.gethostname(), 'pid': os.getpid(),
               'start_time': process_start_time(os.getpid()), 'created': now, 'heartbeat': now,
               'token': uuid.uuid4().hex}
    for _ in range(_ATTEMPTS):
      if self._create(content):
        self._content = content
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._beat, name='workdir-lock-heartbeat',
                                           daemon=True)
        self._heartbeat.start()
        return
      holder = self._read()
      if holder is None:  # Released meanwhile.
        continue
      reason = stale_reason(holder, self.stale_after)
      if reason is None:
        raise WorkdirLockedError(
            f'{self.workdir} is in use by another trainer: {self.path} is held by '
            f'{describe(holder)}, heartbeat {max(time.time() - holder["heartbeat"], 0):.0f} s '
            'ago. Wait for it to finish, use another --workdir, or, if you are sure no trainer '
            f'runs there, delete {self.path}.')
      if not self._take_over(holder, reason):
        time.sleep(_RETRY_SECONDS)  # Another starter is taking it over.
    raise WorkdirLockedError(
        f'{self.workdir}: other trainers keep taking {self.path}; wait for them, or use another '
        '--workdir.')

  def _create(self, content: dict[str, Any]) -> bool:
    """Creates the lock file with `content`, complete, unless it exists; whether it did."""
    temporary = f'{self.path}.{content["token"]}.tmp'
    self._write(temporary, content)
    try:
      os.link(temporary, self.path)
      return True
    except FileExistsError:
      return False
    except OSError as error:
      if error.errno not in _NO_HARD_LINKS:
        raise
    finally:
      os.remove(temporary)
    try:  # No hard links here: exclusive create, then write (readers retry a partial file).
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, 'w', encoding='utf-8') as f:
      json.dump(content, f)
    return True

  def _take_over(self, holder: dict[str, Any], reason: str) -> bool:
    """Removes the stale lock `holder` if this starter wins its claim; whether it did."""
    claim = f'{self.path}.{holder["token"]}.claim'
    try:
      os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
      try:
        if time.time() - os.stat(claim).st_mtime > CLAIM_STALE_SECONDS:
          raise WorkdirLockedError(
              f'{self.workdir}: a takeover of the stale lock {self.path} did not finish; if you '
              f'are sure no trainer runs there, delete {self.path} and {claim}.') from None
      except FileNotFoundError:
        pass
      return False
    try:
      # Under the claim nobody else removes this token's lock, so check-then-remove is safe.
      current = self._read()
      if current is None or current['token'] != holder['token']:
        return False  # Already replaced: the caller looks again.
      logging.warning('Taking over the stale lock %s of %s: %s.', self.path, describe(holder),
                      reason)
      os.remove(self.path)
      return True
    finally:
      os.remove(claim)

  # ----------------------------------------------------------------------- the file

  def _read(self) -> dict[str, Any] | None:
    """The lock file's content, or None when there is none."""
    for _ in range(_ATTEMPTS):
      try:
        with open(self.path, encoding='utf-8') as f:
          text = f.read()
      except FileNotFoundError:
        return None
      try:
        holder = json.loads(text)
        if _well_formed(holder):
          return holder
      except ValueError:
        pass
      time.sleep(_RETRY_SECONDS)  # Being written by an O_EXCL creator, or damaged.
    raise WorkdirLockedError(
        f'{self.workdir}: the lock file {self.path} is unreadable; if you are sure no trainer '
        'runs there, delete it.')

  def _write(self, path: str, content: dict[str, Any]) -> None:
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(content, f)
      f.flush()
      os.fsync(f.fileno())

  def _is_ours(self, holder: dict[str, Any] | None) -> bool:
    mine = self._content
    return holder is not None and mine is not None and all(
        holder.get(key) == mine[key] for key in ('token', 'host', 'pid', 'start_time'))

  def _beat(self) -> None:
    """Rewrites the heartbeat time every `heartbeat_seconds` until released."""
    while not self._stop.wait(self.heartbeat_seconds):
      try:
        if not self._is_ours(self._read()):
          logging.warning('The lock %s is no longer this trainer\'s: its heartbeat stops.',
                          self.path)
          return
        content = {**self._content, 'heartbeat': time.time()}
        temporary = f'{self.path}.{content["token"]}.tmp'
        self._write(temporary, content)
        os.replace(temporary, self.path)
      except (OSError, WorkdirLockedError) as error:  # A full disk: try again next time.
        logging.warning('Could not refresh the heartbeat of %s: %s', self.path, error)
