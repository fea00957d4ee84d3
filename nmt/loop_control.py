"""When the training loop does what and when it stops: task cadences (`is_time`), the run's
training-time clock and budget, and stop requests (SIGTERM, SIGINT) every process agrees on."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

# Exit code of a run stopped by SIGTERM/SIGINT after saving a checkpoint: resumable
# (sysexits' EX_TEMPFAIL, "try again later").
EXIT_INTERRUPTED = 75


def is_time(step: int, every: int, last_step: int) -> bool:
  """Whether a task that runs every `every` steps (and at the last step) runs at `step`."""
  return step % every == 0 or step == last_step


class TrainingClock:
  """The run's training time: the loop's wall time less validation, summed over resumes (a
  checkpoint's meta carries it as 'train_seconds')."""

  def __init__(self, seconds_before: float = 0.0):
    self.seconds_before = seconds_before
    self.start = time.time()
    self.paused_seconds = 0.0  # Time spent in validation since `start`.
    self.paused_at: float | None = None

  def seconds(self) -> float:
    now = time.time()
    paused = self.paused_seconds + (now - self.paused_at if self.paused_at else 0.0)
    return self.seconds_before + now - self.start - paused

  def minutes(self) -> float:
    return self.seconds() / 60

  @contextlib.contextmanager
  def paused(self) -> Iterator[None]:
    """Time inside this block (validation) does not count."""
    self.paused_at = time.time()
    try:
      yield
    finally:
      self.paused_seconds += time.time() - self.paused_at
      self.paused_at = None


def out_of_training_time(clock: TrainingClock, limit_minutes: float, step: int,
                         log_step: bool) -> bool:
  """Whether the run has used its `max_train_minutes` after `step`. With several processes,
  process 0's clock decides, at logging steps only (a broadcast), so all stop together."""
  if not limit_minutes:
    return False
  if jax.process_count() == 1:
    return clock.minutes() >= limit_minutes
  if not log_step:
    return False
  return bool(multihost_utils.broadcast_one_to_all(np.int32(clock.minutes() >= limit_minutes)))


class StopRequests:
  """SIGTERM and SIGINT, turned into a stop after a step that every process agrees on.

  One process: a signal handler notes the request. Several processes: JAX's preemption
  service (started by jax.distributed.initialize) catches SIGTERM on any process and picks a
  step at which `stop_after(step)` is true on all of them, so every process saves the same
  checkpoint and no process waits in a collective for a peer that has left; SIGINT is passed
  on to it as SIGTERM.
  """

  def __init__(self):
    self.coordinated = jax.process_count() > 1
    self.signals: list[int] = []
    self._previous = {}

  def __enter__(self) -> StopRequests:
    caught = (signal.SIGINT,) if self.coordinated else (signal.SIGTERM, signal.SIGINT)
    self._previous = {s: signal.signal(s, self._handle) for s in caught}
    return self

  def __exit__(self, *exc_info) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, signum, frame) -> None:
    del frame
    if self.coordinated:
      os.kill(os.getpid(), signal.SIGTERM)  # To the preemption service's handler.
      return
    logging.warning('Received signal %d: saving a checkpoint and stopping.', signum)
    self.signals.append(signum)

  def stop_after(self, step: int) -> bool:
    """Whether to stop after `step` (call once per step, steps increasing, on every process)."""
    if not self.coordinated:
      return bool(self.signals)
    if multihost_utils.reached_preemption_sync_point(step):
      logging.warning('A process received SIGTERM or SIGINT: every process saves step %d and '
                      'stops.', step)
      self.signals.append(signal.SIGTERM)
      return True
    return False
