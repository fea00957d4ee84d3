"""What a training run records: metrics.jsonl and TensorBoard events (`MetricsWriter`), and the
training steps' metrics, fetched from the devices once per logging interval and summarised
into a log line and a row (`TrainingLog`)."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import jax
from absl import logging

from nmt import console
from nmt.loop_control import TrainingClock, is_time


def truncate_metrics(path: str, start_step: int) -> None:
  """Keeps the rows of metrics.jsonl up to `start_step`, where a run resumes: the steps after
  it are computed (and written) again. A row torn by a kill is dropped too."""
  if not os.path.isfile(path):
    return
  kept = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if start_step > 0 and isinstance(row, dict) and row.get('step', 0) <= start_step:
        kept.append(json.dumps(row) + '\n')
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'w', encoding='utf-8') as f:
    f.writelines(kept)
  os.replace(tmp, path)


class MetricsWriter:
  """metrics.jsonl and TensorBoard event files (clu's writer), on process 0 only.

  A run resumed at `start_step` first drops the rows after it, so every step has its rows once.
  """

  def __init__(self, workdir: str, start_step: int = 0):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      from clu import metric_writers  # Only the writing process needs TensorBoard.
      path = os.path.join(workdir, 'metrics.jsonl')
      truncate_metrics(path, start_step)
      self.jsonl = open(path, 'a', encoding='utf-8')
      self.tensorboard = metric_writers.SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self.enabled:
      return
    self.jsonl.write(json.dumps({'step': step, **metrics}) + '\n')
    self.jsonl.flush()
    self.tensorboard.write_scalars(step, metrics)
    self.tensorboard.flush()

  def close(self) -> None:
    if self.enabled:
      self.jsonl.close()
      self.tensorboard.close()


def summarise_interval(fetched: list[dict], timed_from: int, seconds: float) -> dict[str, float]:
  """Training metrics of the steps since the last log line.

  fetched: each step's metrics as host values; steps before `timed_from` (the compiling first
  step) count for the loss but not for tokens/s. seconds: wall time of the timed steps.
  """
  totals = {k: sum(float(m[k]) for m in fetched) for k in ('loss', 'nll', 'correct', 'tokens')}
  tokens = max(totals['tokens'], 1.0)
  timed = fetched[timed_from:]
  return {
      'train_loss': totals['loss'] / tokens, 'train_nll': totals['nll'] / tokens,
      'train_perplexity': math.exp(min(totals['nll'] / tokens, 50.0)),
      'train_accuracy': totals['correct'] / tokens,
      'grad_norm': float(fetched[-1]['grad_norm']),
      'learning_rate': float(fetched[-1]['learning_rate']),
      'target_tokens_per_second': sum(float(m['tokens']) for m in timed) / max(seconds, 1e-9),
      'seconds_per_step': seconds / max(len(timed), 1),
  }


class TrainingLog:
  """The training steps' metrics of one run of the loop: kept on the devices, then fetched with
  one `jax.device_get` per logging interval (every `log_every_steps` and at the last step),
  logged with throughput and ETA, and written.

  The first step of the loop (tracing and compiling) counts for the loss, not for tokens/s.
  """

  def __init__(self, writer: MetricsWriter, start_step: int, last_step: int, every: int,
               clock: TrainingClock, time_limit_minutes: float):
    self.writer, self.start_step, self.last_step, self.every = writer, start_step, last_step, every
    self.clock, self.time_limit = clock, time_limit_minutes
    self.loop_start = time.time()  # This process's wall time, evaluation included.
    self.pending: list[Any] = []  # Per-step device metrics since the last fetch.
    self.interval_start, self.untimed = time.time(), 0  # untimed: leading compiling steps.
    self.last: dict[str, Any] = {}

  def wall_minutes(self) -> float:
    return (time.time() - self.loop_start) / 60

  def record(self, step: int, metrics: dict[str, jax.Array]) -> list[dict[str, Any]]:
    """Takes step `step`'s metrics; at a logging step, fetches, logs and writes the interval's
    and returns each of its steps' host metrics (else [])."""
    self.pending.append(metrics)
    log_now = is_time(step, self.every, self.last_step)
    if step == self.start_step + 1 and not log_now:
      jax.block_until_ready(metrics)
      logging.info('First step (trace, compile, run): %.1f s.', time.time() - self.interval_start)
      self.interval_start, self.untimed = time.time(), len(self.pending)
    if not log_now:
      return []
    fetched = jax.device_get(self.pending)
    summary = summarise_interval(fetched, self.untimed, time.time() - self.interval_start)
    summary.update(nonfinite_skipped_total=int(fetched[-1]['nonfinite_total']),
                   wall_minutes=self.wall_minutes(), train_minutes=self.clock.minutes())
    self.pending, self.untimed = [], 0
    # The loop's own ETA, not clu's ReportProgress: that one reports through work-unit notes
    # and counts compilation and evaluation time in its rate.
    eta = summary['seconds_per_step'] * (self.last_step - step)
    if self.time_limit:
      eta = min(eta, max(self.time_limit - self.clock.minutes(), 0.0) * 60)
    logging.info('step %d/%d | loss %.3f | nll %.3f | acc %.3f | lr %.2e | %s tok/s | '
                 '%.3f s/step | ETA %s', step, self.last_step, summary['train_loss'],
                 summary['train_nll'], summary['train_accuracy'], summary['learning_rate'],
                 f"{summary['target_tokens_per_second']:,.0f}", summary['seconds_per_step'],
                 console.format_duration(eta))
    self.writer.write(step, summary)
    self.last.update(summary)
    self.interval_start = time.time()
    return fetched

  def write_evaluation(self, step: int, metrics: dict[str, float]) -> None:
    """Writes validation metrics; the time they took is not training throughput."""
    metrics = dict(metrics, wall_minutes=self.wall_minutes(), train_minutes=self.clock.minutes())
    self.writer.write(step, metrics)
    self.last.update(metrics)
    self.interval_start = time.time()


def check_nonfinite_streak(step_metrics: list[dict], limit: int, step: int) -> None:
  """Raises FloatingPointError if `limit` steps in a row were skipped as non-finite.

  step_metrics: the fetched metrics of each step since the last check (their
  'nonfinite_in_a_row' counters), so a streak that ended between two checks still counts.
  """
  longest = max((int(m['nonfinite_in_a_row']) for m in step_metrics), default=0)
  if longest >= limit:
    raise FloatingPointError(
        f'{longest} consecutive steps had a non-finite loss or gradient (checked at step {step}; '
        f'the limit, optimizer.max_consecutive_nonfinite, is {limit}); stopping.')
