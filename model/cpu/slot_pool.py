"""Continuous batching whose slots take new sentences between calls: what an HTTP server needs,
whose sentences arrive while others are being translated (`transformer_continuous_beam_search`
runs a queue known up front). `export.py` exports these functions for `serving.py --http`.

The slots' state, its start and its step are continuous batching's own
(`continuous_batching.empty_slots`, `start_slots`, `step_slots`): each sentence's search is
`beam_search`'s (`beam_step`, its stopping rules, length limits and scores).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from model.cpu.continuous_batching import empty_slots, start_slots, step_slots
from model.tokens import PAD_ID
from model.transformer import Transformer

Array = jax.Array


def slot_pool(model: Transformer, settings: dict[str, Any], width: int,
              max_length: int) -> dict[str, Any]:
  """Four plain functions over a pool of slots, for a model on the CPU decoding path:

    init(slots [n] int32) -> state: n empty slots (only the shape of `slots` is read);
    start(params, sources [k, w] int32) -> started: k sentences (EOS included, PAD_ID-padded
      to any w <= width) encoded on w positions, so short sentences cost a short encoding:
      {'cross': per decoder layer (keys, values) [k, width, heads, head_dim], 'encoder_mask'
      [k, width] bool, 'limits' [k] int32}, padded to the pool's width;
    put(state, started, slot [k] int32) -> state: started sentence i runs in slot[i] (an index
      >= n: none). Only what a start sets is written (not the slots' self-attention cache,
      which a sentence fills before it reads it);
    step(params, state, steps int32 scalar) -> state: up to `steps` beam-search steps of every
      running slot (fewer once all are done). A slot whose sentence ended has done True and its
      result in fin_seqs [n, 1, max_length] and fin_scores [n, 1] until it is admitted again.

  `settings`: beam_size, alpha, max_extra_length, stopping and min_length, as the run's
  decode config. Every leaf of the state has the slots on axis 0, so a caller may take,
  reorder, concatenate or overwrite slots.
  """
  config = model.config
  if not config.use_cpu_decoding:
    raise ValueError('the slot pool runs on the CPU decoding cache (cpu_tuned, softmax).')
  beam, extra = settings['beam_size'], settings['max_extra_length']
  search = dict(alpha=settings['alpha'], nbest=1, stopping=settings['stopping'],
                min_length=settings['min_length'])

  def init(slots: Array) -> dict[str, Any]:
    return empty_slots(config, slots.shape[0], width, beam, max_length, nbest=1)

  def start(params: Any, sources: Array) -> dict[str, Any]:
    if sources.shape[1] > width:
      raise ValueError(f'sources of {sources.shape[1]} positions for a pool {width} wide.')
    encode = lambda m, x: m.decoder.cross_keys_values(m.encode(x))
    cross = model.apply({'params': params}, sources, method=encode)
    lengths = jnp.sum(sources != PAD_ID, axis=1, dtype=jnp.int32)
    # The pool's positions past w: masked, their keys and values zeros.
    pad = lambda x: jnp.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    return {'cross': [(pad(keys), pad(values)) for keys, values in cross],
            'encoder_mask': pad(sources != PAD_ID),
            'limits': jnp.minimum(jnp.where(lengths > 0, lengths + extra, 1), max_length)}

  def put(state: dict[str, Any], started: dict[str, Any], slot: Array) -> dict[str, Any]:
    return start_slots(state, slot, started['cross'], started['encoder_mask'],
                       started['limits'])

  def step(params: Any, state: dict[str, Any], steps: Array) -> dict[str, Any]:
    variables = {'params': params}
    body = lambda carry: (carry[0] + 1, step_slots(model, variables, carry[1], **search))
    cond = lambda carry: (carry[0] < steps) & ~jnp.all(carry[1]['done'])
    return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]

  return {'init': init, 'start': start, 'put': put, 'step': step}
