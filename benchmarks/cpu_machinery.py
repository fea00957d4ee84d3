"""Each CPU-only speed device on the shared path, paired against the same code without it.

  python -m benchmarks.cpu_machinery --workdir runs/multi30k --checkpoint averaged \
      --split test_2016_flickr --variant with=. --variant without_X=/path/to/checkout \
      [--rounds 3] [--train_steps 300] --output results.json

Decoding: every variant (a checkout of the project; the first is the reference) runs
`decode.py --split SPLIT` as the README runs it, twice per round: with an empty compilation
cache (`cold`: a first call, or one whose shapes training did not compile) and with the cache
that variant's own earlier call filled (`warm`: every later call). Variants alternate within
each round, each in its own process, so they share the machine's state.

Training (`--train_steps`): `train.py` on the README's config for that many steps, with and
without the malloc settings a CPU run restarts itself with (`TRANSFORMER_KEEP_MALLOC=1`),
alternating; seconds per step from metrics.jsonl (the compiling first step excluded) and the
whole command's wall time.

Rows give each measurement's median and its ratio to the reference (below 1: the reference
is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(command: list[str], cwd: str, env: dict[str, str]) -> float:
  """Wall seconds of a command that must succeed."""
  start = time.time()
  result = subprocess.run(command, cwd=cwd, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=7200)
  if result.returncode:
    raise RuntimeError(f'{command[:3]} in {cwd} failed: {result.stderr[-3000:]}')
  return time.time() - start


def decode_rows(args: argparse.Namespace, variants: dict[str, str], scratch: str) -> dict:
  tfds = os.path.join(scratch, 'tfds')
  checkpoint = ['--checkpoint', args.checkpoint] if args.checkpoint else []
  rows = {(name, kind): [] for name in variants for kind in ('cold', 'warm')}
  outputs = {}
  for round_index in range(args.rounds):
    for name, repo in variants.items():
      for kind in ('cold', 'warm'):
        number = round_index if kind == 'cold' else 0  # A fresh cache per cold call.
        cache = os.path.join(scratch, f'cache_{name}_{kind}_{number}')
        output = os.path.join(scratch, f'{name}_{kind}.txt')
        command = [sys.executable, 'decode.py', '--workdir', os.path.abspath(args.workdir),
                   '--split', args.split, *checkpoint, '--output', output]
        if kind == 'warm' and not os.path.isdir(cache):  # Its first call fills the cache.
          run(command, repo, {'JAX_COMPILATION_CACHE_DIR': cache, 'TFDS_DATA_DIR': tfds})
        seconds = run(command, repo, {'JAX_COMPILATION_CACHE_DIR': cache, 'TFDS_DATA_DIR': tfds})
        rows[name, kind].append(seconds)
        with open(output, encoding='utf-8') as f:
          outputs[name] = f.read()
        print(f'round {round_index + 1} | decode.py {name} {kind}: {seconds:.2f} s', flush=True)
  reference = next(iter(variants))
  same = {name: text == outputs[reference] for name, text in outputs.items()}
  return summarise(rows, reference) | {'translations_equal_to_reference': same}


def train_rows(args: argparse.Namespace, scratch: str) -> dict:
  variants = {'malloc settings': {}, 'TRANSFORMER_KEEP_MALLOC=1': {'TRANSFORMER_KEEP_MALLOC': '1'}}
  rows = {(name, what): [] for name in variants for what in ('s/step', 'command s')}
  for round_index in range(args.rounds):
    for name, env in variants.items():
      workdir = os.path.join(scratch, f'train_{round_index}_{len(env)}')
      command = [sys.executable, 'train.py', '--config', 'configs/multi30k.py', '--workdir',
                 workdir, f'--config.num_train_steps={args.train_steps}',
                 '--config.eval.every_steps=100000', '--config.eval.bleu_sentences=0',
                 '--config.checkpoint_every_steps=100000', '--config.log_every_steps=50']
      seconds = run(command, REPO, {**env, 'JAX_COMPILATION_CACHE_DIR': os.path.join(
          scratch, 'train_cache'), 'TFDS_DATA_DIR': os.path.join(scratch, 'tfds')})
      with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
        steps = [json.loads(line) for line in f]
      per_step = statistics.median(r['seconds_per_step'] for r in steps
                                   if 'seconds_per_step' in r)
      rows[name, 's/step'].append(per_step)
      rows[name, 'command s'].append(seconds)
      shutil.rmtree(workdir)
      print(f'round {round_index + 1} | train.py {name}: {per_step:.3f} s/step, '
            f'{seconds:.1f} s', flush=True)
  return summarise(rows, 'malloc settings')


def summarise(rows: dict[tuple[str, str], list[float]], reference: str) -> dict:
  """Per (variant, kind): the values, their median, and the reference variant's median of the
  same kind over it."""
  summary = {}
  for (name, kind), values in rows.items():
    median = statistics.median(values)
    summary[f'{name} {kind}'] = {
        'values': values, 'median': median,
        'reference_over_this': statistics.median(rows[reference, kind]) / median}
  return summary


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', help='A trained run (for the decoding rows).')
  parser.add_argument('--checkpoint', default='averaged')
  parser.add_argument('--split', default='test_2016_flickr')
  parser.add_argument('--variant', action='append', default=[],
                      help='NAME=CHECKOUT; the first is the reference')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--train_steps', type=int, default=0, help='0: no training rows.')
  parser.add_argument('--output', default=None)
  args = parser.parse_args()
  variants = dict(v.split('=', 1) for v in args.variant)
  variants = {name: os.path.abspath(path) for name, path in variants.items()}
  scratch = tempfile.mkdtemp(prefix='cpu_machinery_')
  report = {'machine': {'processor': platform.processor() or platform.machine(),
                        'cpus': os.cpu_count()}, 'rounds': args.rounds}
  if variants:
    report['decode'] = decode_rows(args, variants, scratch)
  if args.train_steps:
    report['train'] = train_rows(args, scratch)
  print(json.dumps(report, indent=2))
  if args.output:
    with open(args.output, 'w', encoding='utf-8') as f:
      json.dump(report, f, indent=2)
  shutil.rmtree(scratch, ignore_errors=True)


if __name__ == '__main__':
  main()
