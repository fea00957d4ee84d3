"""Keep-best and early stopping: the best parameters by a validation metric go to
WORKDIR/best/, and training stops after `eval.early_stopping_patience` evaluations without
improvement. The tracker's state travels in every checkpoint's meta, so a resume continues it."""

from __future__ import annotations

import os
from typing import Any

import ml_collections
from absl import logging

from nmt import checkpoints

# eval.keep_best_metric -> (the validation metric it reads, whether higher is better).
BEST_METRICS = {'': (None, True), 'bleu': ('eval_bleu', True), 'chrf': ('eval_chrf', True),
                'loss': ('eval_nll', False)}


class KeepBest:
  """The best value of the metric so far, its step, and the evaluations since it improved."""

  def __init__(self, eval_config: ml_collections.ConfigDict, workdir: str,
               saved: dict[str, Any] | None = None, ema: bool = False):
    self.metric, self.higher_is_better = BEST_METRICS[eval_config.keep_best_metric]
    self.patience = eval_config.early_stopping_patience
    self.workdir, self.ema = workdir, ema
    self.state = dict(saved or {'value': None, 'step': None, 'stale': 0})

  @property
  def stopped(self) -> bool:
    """Whether early stopping has ended the run (also right after a resume)."""
    return bool(self.patience) and self.state['stale'] >= self.patience

  def update(self, step: int, metrics: dict[str, float], params: Any) -> dict[str, float]:
    """Takes the evaluation of `params` at `step`; saves them to WORKDIR/best/ when they beat
    the best so far. Returns the metrics to log with it (the best value and its step)."""
    if self.metric not in metrics:
      return {}
    value, best = metrics[self.metric], self.state['value']
    if best is None or (value > best if self.higher_is_better else value < best):
      self.state.update(value=value, step=step, stale=0)
      checkpoints.save_params_folder(self.workdir, checkpoints.BEST_DIR, params,
                                     {'step': step, 'metric': self.metric, 'value': value,
                                      'ema': self.ema})
      logging.info('New best %s %.4g at step %d: saved to %s.', self.metric, value, step,
                   os.path.join(self.workdir, checkpoints.BEST_DIR))
    else:
      self.state['stale'] += 1
    return {f'best_{self.metric}': self.state['value'], 'best_step': self.state['step']}
