"""Decoding speed: beam search and greedy search on a random model, against the matmul peak.

    python -m benchmarks.decode [--json out.json] [--repeats 3] [--cpu-tuned auto|on|off]

Vocabulary 8000, d_model 256, d_ff 1024, 4 heads, 3+3 layers, float32, random weights;
32 source sentences of 24 tokens; beam 4, alpha 0.6; 39 decoding steps with
force_full_length, so every sentence runs to full length. The peer, the Flax WMT example's
beam search, did 27.5 sentences/s at a 204 GFLOP/s matmul peak on this machine type; the
normalised speedup divides out the peak measured here in the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.matmul_peak import matmul_peak_gflops
from model import (
    Transformer,
    TransformerConfig,
    transformer_beam_search,
    transformer_greedy_search,
)

PEER_SENTENCES_PER_S = 27.5
PEER_PEAK_GFLOPS = 204.0
BATCH, SOURCE_LEN, STEPS, BEAM, ALPHA = 32, 24, 39, 4, 0.6


def _timed(fn, *args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def measure(fn, args, repeats: int) -> dict[str, float]:
  """First call (with compilation) and the best of `repeats` later calls, in seconds."""
  first = _timed(fn, *args)
  best = min(_timed(fn, *args) for _ in range(repeats))
  return {'first_call_s': first, 'best_s': best, 'sentences_per_s': BATCH / best,
          'target_tokens_per_s': BATCH * STEPS / best}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--json', help='also write the results to this file')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--cpu-tuned', choices=('auto', 'on', 'off'), default='auto',
                      help="TransformerConfig.cpu_tuned (auto: on when the backend is 'cpu')")
  args = parser.parse_args()

  cpu_tuned = {'auto': None, 'on': True, 'off': False}[args.cpu_tuned]
  config = TransformerConfig(vocab_size=8000, d_model=256, d_ff=1024, num_heads=4,
                             num_encoder_layers=3, num_decoder_layers=3, dropout_rate=0.0,
                             cpu_tuned=cpu_tuned)
  model = Transformer(config)
  dummy = jnp.ones((1, 4), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), dummy, dummy)['params']
  inputs = jnp.asarray(np.random.default_rng(0).integers(
      3, config.vocab_size, size=(BATCH, SOURCE_LEN)), jnp.int32)
  settings = dict(max_length=STEPS, force_full_length=True)

  peak = matmul_peak_gflops()
  beam = measure(jax.jit(functools.partial(transformer_beam_search, model, beam_size=BEAM,
                                           alpha=ALPHA, **settings)), (params, inputs),
                 args.repeats)
  greedy = measure(jax.jit(functools.partial(transformer_greedy_search, model, **settings)),
                   (params, inputs), args.repeats)
  peak = max(peak, matmul_peak_gflops())  # Again after decoding: the machine is shared.
  results = {
      'setup': dict(vocab=8000, d_model=256, d_ff=1024, heads=4, layers='3+3', dtype='float32',
                    batch=BATCH, source_len=SOURCE_LEN, steps=STEPS, beam=BEAM, alpha=ALPHA,
                    cpu_tuned=config.use_cpu_tuned, backend=jax.default_backend()),
      'matmul_peak_gflops': peak,
      'beam': beam,
      'greedy': greedy,
      'normalised_speedup': (beam['sentences_per_s'] / peak)
                            / (PEER_SENTENCES_PER_S / PEER_PEAK_GFLOPS),
  }
  print(f'matmul peak: {peak:.1f} GFLOP/s')
  for name in ('beam', 'greedy'):
    r = results[name]
    print(f"{name:>6}: {r['sentences_per_s']:.1f} sentences/s, "
          f"{r['target_tokens_per_s']:.0f} target tokens/s, best {r['best_s']:.3f} s, "
          f"first call (with compile) {r['first_call_s']:.2f} s")
  print(f"normalised speedup vs the Flax WMT example: {results['normalised_speedup']:.2f}")
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=2)


if __name__ == '__main__':
  main()
