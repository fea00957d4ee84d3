"""Where a pass of decode.py over real text goes: per batch, its shape, steps and idle rows.

    python -m benchmarks.decode_batches --workdir runs/multi30k --checkpoint averaged \
        --source test_2016_flickr.en [--repeats 2] [--json batches.json]

Batches the source as `decode.py` does (the run's decode settings), compiles each batch
shape's beam search (timed), then times every batch over `--repeats` passes (the fastest
pass is reported). Per batch: rows x padded source length, sentences, the longest output
(the steps a batch runs under `stopping='early'`), the mean output length and the fraction
of row-steps that decode a sentence still running (sum of output lengths / (rows x longest)).
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import numpy as np

import input_pipeline
import sharding
import translation
from model import EOS_ID, transformer_beam_search


def measure(workdir: str, source: str, checkpoint: str | None = None,
            repeats: int = 2) -> dict:
  """The report described in the module docstring, as a dict."""
  config, tokenizer, model = translation.load_run(workdir)
  mesh = sharding.make_mesh()
  params, origin = translation.load_params(workdir, mesh, checkpoint)
  decode = config.decode
  search = jax.jit(functools.partial(
      transformer_beam_search, model, beam_size=decode.beam_size, alpha=decode.alpha,
      max_extra_length=decode.max_extra_length, stopping=decode.get('stopping', 'exact')),
      static_argnames='max_length')
  lines = [line for line in input_pipeline.read_lines(source) if line.strip()]
  batches = input_pipeline.length_batches({'inputs': tokenizer.encode(lines)},
                                          decode.batch_tokens, model.config.max_len)
  max_length = lambda ids: min(ids.shape[1] + decode.max_extra_length, decode.max_length,
                               model.config.max_len)
  compiled, compile_seconds = {}, {}
  for _, arrays in batches:
    ids = arrays['inputs']
    key = (ids.shape, max_length(ids))
    if key not in compiled:
      start = time.time()
      compiled[key] = search.lower(params, ids, max_length=key[1]).compile()
      compile_seconds[f'{ids.shape[0]}x{ids.shape[1]}'] = time.time() - start
  rows = []
  for indices, arrays in batches:
    ids = arrays['inputs']
    program = compiled[(ids.shape, max_length(ids))]
    seconds = []
    for _ in range(repeats):
      start = time.time()
      sequences, _ = jax.device_get(program(params, ids))
      seconds.append(time.time() - start)
    lengths = (np.argmax(sequences[:len(indices), 0] == EOS_ID, axis=1) + 1)
    longest = int(lengths.max())
    rows.append({'shape': f'{ids.shape[0]}x{ids.shape[1]}', 'sentences': len(indices),
                 'longest_output': longest, 'mean_output': float(lengths.mean()),
                 'busy_fraction': float(lengths.sum() / (ids.shape[0] * longest)),
                 'seconds': min(seconds)})
  busy = sum(r['busy_fraction'] * int(r['shape'].split('x')[0]) * r['longest_output']
             for r in rows)
  total = sum(int(r['shape'].split('x')[0]) * r['longest_output'] for r in rows)
  return {'checkpoint': origin, 'sentences': len(lines), 'batches': rows,
          'compile_seconds': compile_seconds, 'pass_seconds': sum(r['seconds'] for r in rows),
          'busy_fraction': busy / total}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--source', required=True)
  parser.add_argument('--checkpoint', default=None)
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--json', default=None)
  args = parser.parse_args()
  report = measure(args.workdir, args.source, args.checkpoint, args.repeats)
  for row in report['batches']:
    print(f"{row['shape']:>8} | {row['sentences']:4d} sentences"
          f" | longest {row['longest_output']:3d} | mean {row['mean_output']:5.1f}"
          f" | busy {row['busy_fraction']:.2f}"
          f" | {row['seconds']:.3f} s")
  print(f"pass {report['pass_seconds']:.2f} s | busy row-steps {report['busy_fraction']:.2f} | "
        f"compiling {sum(report['compile_seconds'].values()):.2f} s")
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(report, f, indent=2)


if __name__ == '__main__':
  main()
