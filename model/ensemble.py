"""Beam search over an ensemble of Transformers: the next token's log-probabilities are the
weighted mean of the members', each member with its own cache."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from model.cpu import decoding as cpu_decoding
from model.search import beam_search
from model.transformer import Transformer
from model.transformer_search import reorder_transformer_cache, transformer_search_setup

Array = jax.Array


def transformer_ensemble_beam_search(models: list[Transformer], params: list[Any],
                                     inputs: Array, *, weights: list[float] | None = None,
                                     beam_size: int = 4, alpha: float = 0.6,
                                     max_length: int | None = None, max_extra_length: int = 50,
                                     nbest: int = 1, stopping: str = 'exact',
                                     token_log_probs: bool = False,
                                     prefix: Array | None = None,
                                     min_length: int = 1) -> tuple[Array, ...]:
  """`beam_search` over an ensemble: the next token's log-probabilities are the weighted mean
  of the members' (default: equal weights), each member with its own cache. Members share the
  vocabulary; they may differ in size. Arguments and results as `transformer_beam_search`.
  """
  if not models or len(models) != len(params):
    raise ValueError(f'need one parameter tree per model, got {len(models)} and {len(params)}.')
  weights = [1.0] * len(models) if weights is None else list(weights)
  if len(weights) != len(models) or min(weights) < 0 or sum(weights) <= 0:
    raise ValueError(f'need {len(models)} non-negative weights, not all 0, got {weights}.')
  outputs = lambda m: getattr(m.config, 'num_outputs', m.config.vocab_size)
  if len({(m.config.vocab_size, outputs(m)) for m in models}) > 1:
    raise ValueError('ensemble members must share the vocabulary size and the output layer\'s '
                     '(model.output_vocab_size).')
  if max_length is None:
    max_length = min(jnp.shape(inputs)[1] + max_extra_length,
                     min(m.config.max_len for m in models))
  members = [transformer_search_setup(m, p, inputs, beam_size, max_length, max_extra_length)
             for m, p in zip(models, params)]
  cpu_tuned = [m.config.use_cpu_decoding for m in models]
  total = sum(weights)

  def step_fn(tokens, step, caches):
    outputs = [fn(tokens, step, cache) for (fn, _, _), cache in zip(members, caches)]
    log_probs = sum(w / total * lp for w, (lp, _) in zip(weights, outputs))
    return log_probs, tuple(cache for _, cache in outputs)

  reorders = [cpu_decoding.reorder_cache if cpu else reorder_transformer_cache
              for cpu in cpu_tuned]
  settings = {k: v for k, v in members[0][2].items() if k in ('batch_size', 'max_length',
                                                               'length_limits')}
  if any(cpu_tuned):  # Every member's cache grows with the loop's pieces (or not at all).
    grows = [cpu_decoding.grow_cache if cpu else (lambda cache, _: cache) for cpu in cpu_tuned]
    settings.update(chunk_length=cpu_decoding.CHUNK_LENGTH,
                    grow_cache=lambda caches, end: tuple(
                        grow(cache, end) for grow, cache in zip(grows, caches)))
  return beam_search(
      step_fn, tuple(cache for _, cache, _ in members), beam_size=beam_size, alpha=alpha,
      nbest=nbest, stopping=stopping, token_log_probs=token_log_probs, prefix=prefix,
      min_length=min_length, reorder_cache=lambda caches, parents: tuple(
          reorder(cache, parents) for reorder, cache in zip(reorders, caches)),
      **settings)
