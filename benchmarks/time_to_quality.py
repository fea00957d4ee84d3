"""Test BLEU against training minutes: every kept checkpoint of a run, translated and scored.

  python -m benchmarks.time_to_quality --workdir runs/multi30k_full [--split test_2016_flickr] \
      [--every_steps 500] [--moving_average] [--alpha A] [--seconds_per_step S] \
      --json runs/multi30k_full/time_to_quality.json
  python -m benchmarks.time_to_quality --plot curves.png A.json B.json ...

The first form translates the split with each checkpoint in WORKDIR/checkpoints (train with
`--config.keep_checkpoints=1000` to keep them all; `--every_steps N`: those at multiples of N,
and the last) and with the average of the last `average_last_checkpoints`, beam search as the
run's config says (`--alpha`: another length penalty, as `decode.py --alpha`;
`--moving_average`: the moving average of the parameters kept in each checkpoint instead, and
the newest one in place of the average, for a run decoded with `decode.py --checkpoint ema`),
and places each on the run's training-minutes axis (train_minutes in metrics.jsonl: the loop's
time less validation; `--seconds_per_step`: a fixed rate instead, for a run trained in an hour
the machine ran slow). It reports the minutes each BLEU threshold (30, 35, ...) was first
reached at. The second form plots the curves of several such files next to the Flax WMT
example's measured points on the same machine type (../shared/ANCHORS.md); with `--metric
bleu_tok_lc`, BLEU tok-lc (the Multi30k papers' metric) next to the best published text-only
result from the same 29k pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from nmt import runs, scoring
from nmt import translator as translator_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The Flax WMT example on Multi30k en->de, 2-core AMD EPYC: (training minutes, test_2016_flickr
# sacreBLEU cased), from ../shared/ANCHORS.md.
PEER_POINTS = [(20.0, 25.5), (35.0, 31.7), (50.0, 34.7)]
THRESHOLDS = (30.0, 35.0, 38.0, 40.0, 42.0)
# Wu et al. 2021's Transformer-tiny on test_2016_flickr, BLEU tok-lc (the papers' metric).
PUBLISHED_TOK_LC = {'Wu et al. 2021, Transformer-tiny (41.02)': 41.02}
METRICS = {'bleu': 'sacreBLEU (cased)', 'bleu_tok_lc': "BLEU tok-lc (Multi30k papers' metric)"}


def minutes_of_steps(workdir: str, steps: list[int], seconds_per_step: float = 0.0) -> list[float]:
  """Training minutes at each step: the run's own (metrics.jsonl), or at a fixed rate."""
  if seconds_per_step > 0:
    return [step * seconds_per_step / 60 for step in steps]
  from benchmarks import plot_curves
  timeline = plot_curves.minutes_at(plot_curves.read_metrics(
      os.path.join(workdir, 'metrics.jsonl')))
  if timeline is None:
    raise SystemExit(f'error: {workdir}/metrics.jsonl has no training times.')
  return [float(m) for m in np.interp(steps, *timeline)]


def first_reaching(points: list[dict], threshold: float) -> float | None:
  """Training minutes of the first single checkpoint at or above `threshold` BLEU."""
  return next((p['minutes'] for p in points if p['bleu'] >= threshold), None)


def measure(workdir: str, split: str, every_steps: int = 0,
            moving_average: bool = False, alpha: float | None = None,
            seconds_per_step: float = 0.0) -> dict:
  sys.path.insert(0, REPO)
  import input_pipeline
  from nmt import checkpoints, legacy, sharding

  config, tokenizer, model = runs.load_run(workdir)
  mesh = sharding.make_mesh()
  sources, references = input_pipeline.read_split(config, split)
  translator = translator_lib.Translator(model, tokenizer, config.decode, mesh, alpha=alpha)
  lang = config.data.target_lang
  steps = checkpoints.saved_steps(workdir)
  if not steps:
    raise SystemExit(f'error: no checkpoints in {workdir}.')
  if every_steps:
    steps = [s for s in steps if s % every_steps == 0 or s == steps[-1]]
  minutes = minutes_of_steps(workdir, steps, seconds_per_step)
  points = []
  if moving_average and not os.path.isdir(os.path.join(checkpoints.step_path(workdir, steps[-1]),
                                                       'ema')):
    raise SystemExit(f'error: the checkpoints of {workdir} hold no moving average of the '
                     'parameters (trained without optimizer.ema_decay): drop --moving_average.')
  for step, at in zip(steps, minutes):
    if moving_average:
      params = legacy.upgrade_params(checkpoints.read_checkpoint(
          checkpoints.step_path(workdir, step), {'ema': sharding.replicated(mesh)},
          step=step)['ema'])
    else:
      params, _ = runs.load_params(workdir, mesh, step)
    scores = scoring.score(translator(params, sources), references, lang)
    points.append({'step': step, 'minutes': at, 'bleu': scores['bleu'],
                   'bleu_lowercase': scores['bleu_lowercase'], 'chrf': scores['chrf'],
                   'bleu_tok_lc': scores['bleu_tok_lc']})
    print(json.dumps(points[-1]), flush=True)
  if moving_average:
    params, origin = runs.load_params(workdir, mesh, 'ema')
  else:
    count = min(config.average_last_checkpoints, len(checkpoints.saved_steps(workdir)))
    params, origin = runs.load_params(workdir, mesh, None, count)
  scores = scoring.score(translator(params, sources), references, lang)
  final = {'checkpoint': origin, 'minutes': minutes[-1], 'bleu': scores['bleu'],
           'bleu_lowercase': scores['bleu_lowercase'], 'chrf': scores['chrf'],
           'bleu_tok_lc': scores['bleu_tok_lc']}
  print(json.dumps(final), flush=True)
  return {'workdir': os.path.abspath(workdir), 'split': split, 'points': points,
          'moving_average': moving_average, 'averaged': final,
          'alpha': config.decode.alpha if alpha is None else alpha,
          'seconds_per_step': seconds_per_step or None,
          'minutes_to': {f'{t:g}': first_reaching(points, t) for t in THRESHOLDS}}


def plot(results: list[dict], labels: list[str], output: str, metric: str = 'bleu') -> str:
  """The runs' `metric` against training minutes, with the references measured in it: the
  Flax WMT example's points (sacreBLEU) or the published result (BLEU tok-lc)."""
  from benchmarks import plot_curves
  curves = {}
  for label, result in zip(labels, results):
    points = result['points']
    if any(metric not in p for p in points):
      raise SystemExit(f'error: {result["workdir"]} has no {metric} points: measure it again.')
    curves[label] = (np.asarray([p['minutes'] for p in points]),
                     np.asarray([p[metric] for p in points]))
  tok_lc = metric == 'bleu_tok_lc'
  kinds = {'moving averages' if r.get('moving_average') else 'single checkpoints'
           for r in results}
  return plot_curves.plot_runs(
      curves, output, f'{results[0]["split"]} {METRICS[metric]}\n{" and ".join(sorted(kinds))}',
      'Multi30k en-de: BLEU against training minutes',
      points=None if tok_lc else {'Flax WMT example (ANCHORS.md)': PEER_POINTS},
      levels=PUBLISHED_TOK_LC if tok_lc else None)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', help='A train.py run to measure.')
  parser.add_argument('--split', default='test_2016_flickr')
  parser.add_argument('--every_steps', type=int, default=0,
                      help='Only the checkpoints at multiples of this (and the last).')
  parser.add_argument('--moving_average', action='store_true',
                      help="Each checkpoint's moving average of the parameters (a run trained "
                      'with optimizer.ema_decay and decoded with --checkpoint ema).')
  parser.add_argument('--alpha', type=float, default=None,
                      help="Length-penalty exponent (default: the run's decode.alpha).")
  parser.add_argument('--seconds_per_step', type=float, default=0.0,
                      help="Place each checkpoint at step x this instead of the run's logged "
                      'minutes: for a run trained while the machine ran slow, at the rate '
                      'measured for a step of the same cost in another run.')
  parser.add_argument('--json', help='Write the measurement here.')
  parser.add_argument('--plot', help='PNG of the curves in the given JSON files.')
  parser.add_argument('--labels', help='Comma-separated labels for --plot (default: run names).')
  parser.add_argument('--metric', default='bleu', choices=sorted(METRICS),
                      help='What --plot draws.')
  parser.add_argument('files', nargs='*', help='--plot: measurements written by --json.')
  args = parser.parse_args(argv)
  if bool(args.workdir) == bool(args.plot):
    parser.error('give either --workdir (measure) or --plot with JSON files.')
  if args.plot:
    if not args.files:
      parser.error('--plot needs the JSON files to draw.')
    results = []
    for path in args.files:
      with open(path, encoding='utf-8') as f:
        results.append(json.load(f))
    labels = (args.labels.split(',') if args.labels else
              [os.path.basename(r['workdir']) for r in results])
    if len(labels) != len(results):
      parser.error(f'{len(labels)} labels for {len(results)} files.')
    print(f'wrote {plot(results, labels, args.plot, args.metric)}')
    return results
  result = measure(args.workdir, args.split, args.every_steps, args.moving_average, args.alpha,
                   args.seconds_per_step)
  print(json.dumps(result['minutes_to']))
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(result, f, indent=2)
  return result


if __name__ == '__main__':
  main()
