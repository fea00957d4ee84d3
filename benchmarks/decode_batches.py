"""Where a pass of decode.py over real text goes: per batch, its shape, steps and idle rows.

    python -m benchmarks.decode_batches --workdir runs/multi30k --checkpoint averaged \
        --source test_2016_flickr.en [--repeats 2] [--json batches.json]

Batches the source as `decode.py` does (the run's decode settings), compiles each batch
shape's beam search (timed), then times every batch over `--repeats` passes (the fastest
pass is reported). Per batch: rows x padded source length, sentences, the longest output
(the steps a batch runs under `stopping='early'`), the mean output length and the fraction
of row-steps that decode a sentence still running (sum of output lengths / (rows x longest)).
Then the same sentences through continuous batching (`model/cpu/continuous_batching.py`, what
`decode.py` runs on one CPU device for more than `translator_lib.CONTINUOUS_SLOTS` sentences):
its compile time, its pass, and whether its translations equal the batches'.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import numpy as np

from model import EOS_ID, transformer_beam_search, transformer_continuous_beam_search
from nmt import batching, runs, sharding, text_io
from nmt import translator as translator_lib


def measure(workdir: str, source: str, checkpoint: str | None = None,
            repeats: int = 2) -> dict:
  """The report described in the module docstring, as a dict."""
  config, tokenizer, model = runs.load_run(workdir)
  mesh = sharding.make_mesh()
  params, origin = runs.load_params(workdir, mesh, checkpoint)
  decode = config.decode
  search = jax.jit(functools.partial(
      transformer_beam_search, model, beam_size=decode.beam_size, alpha=decode.alpha,
      max_extra_length=decode.max_extra_length, stopping=decode.stopping,
      min_length=decode.min_length), static_argnames='max_length')
  lines = [line for line in text_io.read_lines(source) if line.strip()]
  batches = batching.length_batches({'inputs': tokenizer.encode(lines)},
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
  rows, batch_best = [], {}
  for indices, arrays in batches:
    ids = arrays['inputs']
    program = compiled[(ids.shape, max_length(ids))]
    seconds = []
    for _ in range(repeats):
      start = time.time()
      sequences, _ = jax.device_get(program(params, ids))
      seconds.append(time.time() - start)
    batch_best.update((int(i), sequences[r, 0]) for r, i in enumerate(indices))
    lengths = (np.argmax(sequences[:len(indices), 0] == EOS_ID, axis=1) + 1)
    longest = int(lengths.max())
    rows.append({'shape': f'{ids.shape[0]}x{ids.shape[1]}', 'sentences': len(indices),
                 'longest_output': longest, 'mean_output': float(lengths.mean()),
                 'busy_fraction': float(lengths.sum() / (ids.shape[0] * longest)),
                 'seconds': min(seconds)})
  continuous = measure_continuous(model, params, tokenizer.encode(lines), decode, repeats,
                                  batch_best)
  busy = sum(r['busy_fraction'] * int(r['shape'].split('x')[0]) * r['longest_output']
             for r in rows)
  total = sum(int(r['shape'].split('x')[0]) * r['longest_output'] for r in rows)
  return {'checkpoint': origin, 'sentences': len(lines), 'batches': rows,
          'compile_seconds': compile_seconds, 'pass_seconds': sum(r['seconds'] for r in rows),
          'busy_fraction': busy / total, 'continuous': continuous}


def measure_continuous(model, params, sources: list[np.ndarray], decode, repeats: int,
                       batch_best: dict[int, np.ndarray]) -> dict:
  """Compile time and fastest pass of continuous batching over `sources` (queued as the
  Translator queues them), and whether its best translations equal `batch_best` (by index)."""
  (order, queue), *more = translator_lib.continuous_queues(sources)
  if more:
    raise ValueError(f'{len(sources)} sentences make {1 + len(more)} queues; time one.')
  search = jax.jit(functools.partial(
      transformer_continuous_beam_search, model,
      slots=translator_lib.CONTINUOUS_SLOTS, refill=translator_lib.CONTINUOUS_REFILL,
      beam_size=decode.beam_size, alpha=decode.alpha, max_extra_length=decode.max_extra_length,
      stopping=decode.stopping, min_length=decode.min_length),
      static_argnames='max_length')
  max_length = min(queue.shape[1] + decode.max_extra_length, decode.max_length,
                   model.config.max_len)
  start = time.time()
  program = search.lower(params, queue, np.int32(len(order)), max_length=max_length).compile()
  compile_seconds = time.time() - start
  seconds = []
  for _ in range(repeats):
    start = time.time()
    sequences, _ = jax.device_get(program(params, queue, np.int32(len(order))))
    seconds.append(time.time() - start)
  ended = lambda x: x[:int(np.argmax(x == EOS_ID)) + 1]  # Up to the EOS.
  same = all(np.array_equal(ended(sequences[row, 0]), ended(batch_best[int(i)]))
             for row, i in enumerate(order))
  return {'queue': 'x'.join(map(str, queue.shape)), 'compile_seconds': compile_seconds,
          'pass_seconds': min(seconds), 'same_translations_as_batches': same}


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
  continuous = report['continuous']
  print(f"continuous batching ({continuous['queue']} queue): pass "
        f"{continuous['pass_seconds']:.2f} s | compiling {continuous['compile_seconds']:.2f} s | "
        f"same translations: {continuous['same_translations_as_batches']}")
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(report, f, indent=2)


if __name__ == '__main__':
  main()
