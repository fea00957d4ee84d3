"""The attention systems of the Transformer's story on the same data and training budget.

  MULTI30K_DIR=../shared/data/multi30k python -m benchmarks.attention_comparison \
      --variant transformer_softmax --workdir runs/compare [--minutes 20]
  python -m benchmarks.attention_comparison --report --workdir runs/compare \
      [--json compare.json] [--plot compare.png]

Multi30k en->de, one row per --variant: the Transformer with softmax attention (the paper),
sparsemax, 1.5-entmax or linear attention, and the attentional RNN (model/rnn.py) with
Bahdanau's additive or Luong's general attention. Each trains WORKDIR/VARIANT with train.py for
--minutes of training time (`max_train_minutes`: the loop's time less validation), everything
else as its config file says, with the paper's schedule (no cooldown, since a time budget has no
known last step) and validation BLEU on 256 sentences every 250 steps; then translates
test_2016_flickr with its last 3 checkpoints averaged, beam 4, twice in one process (the first
call compiles, the second is the steady state), and writes WORKDIR/VARIANT/comparison.json.
--report gathers them into one table (markdown on stdout) and draws validation BLEU against
training minutes. Run the variants one at a time on an otherwise idle machine: the budget is
wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from nmt import runs, scoring
from nmt import translator as translator_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (config file, overrides, what it is).
VARIANTS = {
    'transformer_softmax': ('configs/multi30k.py', [], 'Transformer, softmax (the paper)'),
    'transformer_sparsemax': ('configs/multi30k.py', ['--config.model.attention_probs=sparsemax'],
                              'Transformer, sparsemax'),
    'transformer_entmax15': ('configs/multi30k.py', ['--config.model.attention_probs=entmax15'],
                             'Transformer, 1.5-entmax'),
    'transformer_linear': ('configs/multi30k.py', ['--config.model.linear_attention=True'],
                           'Transformer, linear attention'),
    'rnn_bahdanau': ('configs/multi30k_rnn.py', [], 'RNN, Bahdanau (additive) attention'),
    'rnn_luong': ('configs/multi30k_rnn.py', ['--config.model.attention_score=general'],
                  'RNN, Luong (general) attention'),
}
AVERAGE_LAST = 3
SPLIT = 'test_2016_flickr'


def train_command(variant: str, workdir: str, minutes: float) -> list[str]:
  config, overrides, _ = VARIANTS[variant]
  return [sys.executable, 'train.py', f'--config={config}', f'--workdir={workdir}',
          *overrides, f'--config.max_train_minutes={minutes}',
          '--config.num_train_steps=1000000', '--config.optimizer.cooldown_fraction=0',
          '--config.eval.bleu_every_steps=250', '--config.eval.every_steps=250']


def training_summary(run: str) -> dict:
  """Parameters, steps, training minutes and target tokens/s from the run's metrics.jsonl."""
  from benchmarks import plot_curves
  try:
    metrics = plot_curves.read_metrics(os.path.join(run, 'metrics.jsonl'))
  except plot_curves.CurvesError as e:
    raise SystemExit(f'error: {e}') from None
  logged = [dict(row, step=step) for step, row in metrics.items()
            if 'target_tokens_per_second' in row]
  if not logged:
    raise SystemExit(f'error: {run}/metrics.jsonl has no training rows: did training run?')
  return {
      'params': int(next(r['num_params'] for r in metrics.values() if 'num_params' in r)),
      'steps': logged[-1]['step'],
      'train_minutes': logged[-1]['train_minutes'],
      # Intervals after the first (which compiles), each a median-robust speed reading.
      'train_target_tokens_per_s': statistics.median(
          r['target_tokens_per_second'] for r in logged[1:] or logged),
  }


def translate_test(run: str) -> dict:
  """test_2016_flickr with the last checkpoints averaged: scores, first and second call."""
  sys.path.insert(0, REPO)
  import jax

  import input_pipeline
  from nmt import sharding

  config, tokenizer, model = runs.load_run(run)
  mesh = sharding.make_mesh()
  params, origin = runs.load_params(run, mesh, None, AVERAGE_LAST)
  sources, references = input_pipeline.read_split(config, SPLIT)
  translator = translator_lib.Translator(model, tokenizer, config.decode, mesh)
  params = jax.device_put(params, sharding.replicated(mesh))
  start = time.time()
  hypotheses = translator(params, sources)
  first = time.time() - start
  start = time.time()
  again = translator(params, sources)
  steady = time.time() - start
  assert again == hypotheses, 'the second call translated differently'
  scores = scoring.score(hypotheses, references)
  with open(os.path.join(run, f'{SPLIT}.hyp'), 'w', encoding='utf-8') as f:
    f.writelines(h + '\n' for h in hypotheses)
  return {'checkpoint': origin, 'sentences': len(sources),
          'bleu': scores['bleu'], 'bleu_lowercase': scores['bleu_lowercase'],
          'chrf': scores['chrf'], 'bleu_signature': scores['bleu_signature'],
          'decode_first_call_s': first, 'decode_sentences_per_s': len(sources) / steady}


def run_variant(variant: str, workdir: str, minutes: float) -> dict:
  run = os.path.join(workdir, variant)
  command = train_command(variant, run, minutes)
  print('$', ' '.join(command[1:]), flush=True)
  start = time.time()
  subprocess.run(command, cwd=REPO, check=True)
  result = {'variant': variant, 'what': VARIANTS[variant][2], 'budget_minutes': minutes,
            'command': 'python ' + ' '.join(command[1:]),
            'train_command_minutes': (time.time() - start) / 60,
            **training_summary(run), **translate_test(run)}
  with open(os.path.join(run, 'comparison.json'), 'w', encoding='utf-8') as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))
  return result


def report(workdir: str, json_path: str | None, plot_path: str | None) -> list[dict]:
  results = []
  for variant in VARIANTS:
    path = os.path.join(workdir, variant, 'comparison.json')
    if os.path.isfile(path):
      with open(path, encoding='utf-8') as f:
        results.append(json.load(f))
  if not results:
    raise SystemExit(f'error: no {workdir}/VARIANT/comparison.json yet: run --variant first.')
  print('| system | parameters | steps in the budget | training target tok/s | BLEU | '
        'BLEU (lowercased) | chrF | decoding sentences/s (first call, compiling) |')
  print('|---|---|---|---|---|---|---|---|')
  for r in results:
    first = r['sentences'] / r['decode_first_call_s']
    print(f"| {r['what']} | {r['params'] / 1e6:.1f}M | {r['steps']:,} | "
          f"{r['train_target_tokens_per_s']:,.0f} | {r['bleu']:.2f} | {r['bleu_lowercase']:.2f} | "
          f"{r['chrf']:.2f} | {r['decode_sentences_per_s']:.1f} ({first:.1f}) |")
  if json_path:
    with open(json_path, 'w', encoding='utf-8') as f:
      json.dump(results, f, indent=2)
  if plot_path:
    from benchmarks import plot_curves
    curves = {}
    for r in results:
      metrics = plot_curves.read_metrics(os.path.join(workdir, r['variant'], 'metrics.jsonl'))
      try:
        curves[r['what']] = plot_curves.score_against_minutes(metrics)
      except plot_curves.CurvesError:  # Too few steps for a validation BLEU in the budget.
        print(f"{r['variant']}: no validation BLEU in its budget; not in the plot.",
              file=sys.stderr)
    plot_curves.plot_runs(curves, plot_path, 'validation BLEU (256 sentences, no averaging)',
                          f'Multi30k en-de, {results[0]["budget_minutes"]:g} training minutes each')
    print(f'wrote {plot_path}', file=sys.stderr)
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', required=True, help='Holds one run folder per variant.')
  what = parser.add_mutually_exclusive_group(required=True)
  what.add_argument('--variant', choices=sorted(VARIANTS))
  what.add_argument('--report', action='store_true')
  parser.add_argument('--minutes', type=float, default=20.0, help='Training minutes per run.')
  parser.add_argument('--json', help='--report: also write the rows here.')
  parser.add_argument('--plot', help='--report: the PNG of BLEU against training minutes.')
  args = parser.parse_args(argv)
  if args.report:
    return report(args.workdir, args.json, args.plot)
  return run_variant(args.variant, os.path.abspath(args.workdir), args.minutes)


if __name__ == '__main__':
  main()
