"""Decoding time per token against output length: softmax attention's cache grows by one
entry per step, linear attention's state does not ("Transformers are RNNs").

    python -m benchmarks.linear_decoding [--json out.json] [--lengths 32,64,128,256,512]

Random weights of the Multi30k model's shape (vocabulary 8000, d_model 256, d_ff 1024,
4 heads, 3+3 layers, float32) with softmax or linear attention; 8 sources of 24 tokens, beam 4,
every sentence forced to the full output length. Both models decode with the searches the
product uses on this backend (on CPU, softmax with model/cpu/decoding.py's growing cache).
Per length and model: the best of `--repeats` runs after a compiling one, as milliseconds per
decoding step.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.decode import measure
from model import Transformer, TransformerConfig, transformer_beam_search

BATCH, SOURCE_LEN, BEAM = 8, 24, 4


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--json', help='also write the results to this file')
  parser.add_argument('--lengths', default='32,64,128,256,512')
  parser.add_argument('--repeats', type=int, default=2)
  args = parser.parse_args()
  lengths = [int(n) for n in args.lengths.split(',')]

  inputs = jnp.asarray(np.random.default_rng(0).integers(3, 8000, size=(BATCH, SOURCE_LEN)),
                       jnp.int32)
  rows = []
  for name, linear in (('softmax', False), ('linear', True)):
    config = TransformerConfig(vocab_size=8000, d_model=256, d_ff=1024, num_heads=4,
                               num_encoder_layers=3, num_decoder_layers=3, dropout_rate=0.0,
                               max_len=max(lengths), linear_attention=linear)
    model = Transformer(config)
    dummy = jnp.ones((1, 4), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), dummy, dummy)['params']
    for length in lengths:
      search = jax.jit(functools.partial(transformer_beam_search, model, beam_size=BEAM,
                                         alpha=0.6, max_length=length, max_extra_length=length,
                                         force_full_length=True))
      timing = measure(search, (params, inputs), args.repeats)
      rows.append(dict(attention=name, output_length=length,
                       ms_per_step=1000 * timing['best_s'] / length,
                       first_call_s=timing['first_call_s'], best_s=timing['best_s']))
      print(f'{name:8s} length {length:4d}: {rows[-1]["ms_per_step"]:7.2f} ms/step '
            f'({timing["best_s"]:.2f} s, first call {timing["first_call_s"]:.1f} s)', flush=True)
  by = {(r['attention'], r['output_length']): r['ms_per_step'] for r in rows}
  results = {
      'setup': dict(vocab=8000, d_model=256, d_ff=1024, heads=4, layers='3+3', dtype='float32',
                    batch=BATCH, source_len=SOURCE_LEN, beam=BEAM,
                    backend=jax.default_backend()),
      'rows': rows,
      # How much a step slows from the shortest to the longest output, per model.
      'growth': {name: by[(name, lengths[-1])] / by[(name, lengths[0])]
                 for name in ('softmax', 'linear')},
  }
  print(json.dumps(results['growth']))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=2)


if __name__ == '__main__':
  main()
