"""Training curves of a run directory: loss, validation NLL and BLEU against steps and minutes.

  python -m benchmarks.plot_curves --workdir DIR [--output DIR/curves.png]
  python -m benchmarks.plot_curves --compare DIR1 DIR2 ... --output bleu.png [--key eval_chrf]

The second form draws one validation score of several runs against their training minutes.

Reads DIR/metrics.jsonl as train.py writes it: one JSON object per line with 'step' and
whatever that log line measured (training lines: train_loss, train_nll, seconds_per_step, ...;
evaluation lines: eval_nll, eval_bleu, eval_chrf, ...). Lines of one step are merged; a resumed
run repeats steps, and the last value of each key at a step wins. Minutes are the lines'
'train_minutes' (training time, validation excluded) when they have them, else seconds_per_step
times the steps since the previous training line (runs of older code).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import matplotlib

matplotlib.use('Agg')  # Files only: works without a display.
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

LOSS_KEYS = (('train_loss', 'training loss (smoothed)'), ('train_nll', 'training NLL'),
             ('eval_nll', 'validation NLL'))
SCORE_KEYS = (('eval_bleu', 'validation BLEU'), ('eval_chrf', 'validation chrF'))


class CurvesError(ValueError):
  """The metrics file is missing, empty or has nothing to plot."""


def read_metrics(path: str) -> dict[int, dict[str, float]]:
  """{step: {key: value}} merged over every line of the step; later lines win.

  A line that is not valid JSON (a run writing it right now, or a crash mid-line) is skipped.
  """
  if not os.path.isfile(path):
    raise CurvesError(f'{path} does not exist: is --workdir a train.py run directory?')
  records: dict[int, dict[str, float]] = {}
  with open(path, encoding='utf-8') as f:
    for number, line in enumerate(f, 1):
      line = line.strip()
      if not line:
        continue
      try:
        entry = json.loads(line)
      except json.JSONDecodeError:
        print(f'warning: {path}:{number} is not valid JSON; skipped.', file=sys.stderr)
        continue
      if not isinstance(entry, dict) or 'step' not in entry:
        continue
      step = int(entry.pop('step'))
      values = {k: float(v) for k, v in entry.items()
                if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
      records.setdefault(step, {}).update(values)
  if not records:
    raise CurvesError(f'{path} has no metrics yet (no line with a "step").')
  return dict(sorted(records.items()))


def series(records: dict[int, dict[str, float]], key: str) -> tuple[np.ndarray, np.ndarray]:
  """Steps and values of one key, in step order."""
  steps = [s for s, r in records.items() if key in r]
  return np.asarray(steps, np.float64), np.asarray([records[s][key] for s in steps], np.float64)


def minutes_at(records: dict[int, dict[str, float]]) -> tuple[np.ndarray, np.ndarray] | None:
  """(steps, minutes of training) known at some steps, step 0 at minute 0, or None.

  From 'train_minutes' when logged; otherwise seconds_per_step applies to the steps since the
  previous training log line (or since step 0).
  """
  steps, minutes = series(records, 'train_minutes')
  if len(steps):
    return np.concatenate([[0.0], steps]), np.concatenate([[0.0], minutes])
  steps, seconds_per_step = series(records, 'seconds_per_step')
  if not len(steps):
    return None
  elapsed = np.cumsum(np.diff(steps, prepend=0.0) * seconds_per_step)
  return np.concatenate([[0.0], steps]), np.concatenate([[0.0], elapsed]) / 60.0


def _draw(ax, records, keys, to_x, xlabel, ylabel, title):
  """One panel: every key that has values, against to_x(steps); a note if none has any."""
  drawn = False
  for key, label in keys:
    steps, values = series(records, key)
    if not len(steps):
      continue
    marker = 'o' if key.startswith('eval') else None
    ax.plot(to_x(steps), values, label=label, marker=marker, markersize=3, linewidth=1.2)
    drawn = True
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(True, alpha=0.3)
  if drawn:
    ax.legend(fontsize=8)
  else:
    ax.text(0.5, 0.5, f'no {ylabel} yet', ha='center', va='center', transform=ax.transAxes,
            color='gray')
    ax.set_xticks([])
    ax.set_yticks([])
  return drawn


def plot(records: dict[int, dict[str, float]], output: str, title: str = '') -> str:
  """Writes the 2x2 figure (steps on top, minutes below) to `output`; returns its path."""
  if not any(series(records, k)[0].size for k, _ in LOSS_KEYS + SCORE_KEYS):
    raise CurvesError('the metrics have no train_loss, train_nll, eval_nll, eval_bleu or '
                      'eval_chrf values to plot yet.')
  timeline = minutes_at(records)
  fig, axes = plt.subplots(2, 2, figsize=(12, 8), squeeze=False)
  identity = lambda steps: steps
  _draw(axes[0, 0], records, LOSS_KEYS, identity, 'step', 'loss / NLL (nats per token)',
        'Loss vs step')
  _draw(axes[0, 1], records, SCORE_KEYS, identity, 'step', 'BLEU / chrF',
        'Validation score vs step')
  if timeline is None:
    for ax in axes[1]:
      ax.text(0.5, 0.5, 'no seconds_per_step or train_minutes logged', ha='center', va='center',
              transform=ax.transAxes, color='gray')
      ax.set_axis_off()
  else:
    known_steps, known_minutes = timeline
    # Evaluation lines fall between training lines: place them on the training timeline.
    to_minutes = lambda steps: np.interp(steps, known_steps, known_minutes)
    _draw(axes[1, 0], records, LOSS_KEYS, to_minutes, 'minutes of training',
          'loss / NLL (nats per token)', 'Loss vs time')
    _draw(axes[1, 1], records, SCORE_KEYS, to_minutes, 'minutes of training', 'BLEU / chrF',
          'Validation score vs time')
  last = max(records)
  fig.suptitle(f'{title}  (last step {last:,})' if title else f'last step {last:,}')
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  fig.savefig(output, dpi=100)
  plt.close(fig)
  return output


def score_against_minutes(records: dict[int, dict[str, float]],
                          key: str = 'eval_bleu') -> tuple[np.ndarray, np.ndarray]:
  """(training minutes, values) of one validation key."""
  timeline = minutes_at(records)
  steps, values = series(records, key)
  if timeline is None or not len(steps):
    raise CurvesError(f'no {key} values with training times to plot.')
  return np.interp(steps, *timeline), values


def plot_runs(curves: dict[str, tuple[np.ndarray, np.ndarray]], output: str, ylabel: str,
              title: str = '', points: dict[str, list[tuple[float, float]]] | None = None,
              levels: dict[str, float] | None = None) -> str:
  """One panel: each run's (minutes, values) as a line; `points`: labelled single markers
  (e.g. another system's measurements); `levels`: labelled horizontal lines (e.g. a published
  score). Returns the PNG path."""
  fig, ax = plt.subplots(figsize=(8, 5))
  for label, (minutes, values) in curves.items():
    ax.plot(minutes, values, marker='o', markersize=3, linewidth=1.4, label=label)
  for label, xy in (points or {}).items():
    ax.plot(*zip(*xy), linestyle='none', marker='s', markersize=7, label=label)
  for label, value in (levels or {}).items():
    ax.axhline(value, color='black', linestyle='--', linewidth=1, label=label)
  ax.set_xlabel('minutes of training')
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  fig.savefig(output, dpi=100)
  plt.close(fig)
  return output


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  runs = parser.add_mutually_exclusive_group(required=True)
  runs.add_argument('--workdir', help='Run directory holding metrics.jsonl.')
  runs.add_argument('--compare', nargs='+', help='Run directories: one score of each against '
                    'training minutes, in one panel.')
  parser.add_argument('--key', default='eval_bleu', help='The score --compare draws.')
  parser.add_argument('--output', default='', help='PNG path (default: WORKDIR/curves.png; '
                      'required with --compare).')
  args = parser.parse_args(argv)
  if args.compare and not args.output:
    parser.error('--compare needs --output.')
  output = args.output or os.path.join(args.workdir, 'curves.png')
  name = lambda workdir: os.path.basename(os.path.normpath(workdir))
  try:
    if args.compare:
      curves = {name(w): score_against_minutes(read_metrics(os.path.join(w, 'metrics.jsonl')),
                                               args.key) for w in args.compare}
      path = plot_runs(curves, output, f'validation {args.key.removeprefix("eval_")}')
    else:
      records = read_metrics(os.path.join(args.workdir, 'metrics.jsonl'))
      path = plot(records, output, title=name(args.workdir))
  except CurvesError as error:
    sys.exit(f'error: {error}')
  print(f'wrote {path}')
  return path


if __name__ == '__main__':
  main()
