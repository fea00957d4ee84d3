"""The searches of `model/search.py` run on a Transformer (or the RNN, which shares its
interface): its step function, its decoding cache, and on the CPU the hooks of
`model/cpu/decoding.py`."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from model.cpu import decoding as cpu_decoding
from model.search import StepFn, beam_search, gather_beams, greedy_search, sample
from model.tokens import PAD_ID
from model.transformer import Transformer

Array = jax.Array


def reorder_transformer_cache(cache: dict[str, Any], parents: Array) -> dict[str, Any]:
  """Gathers the entries named self_* [batch, beam, ...], at the top level and per layer (the
  Transformer's self-attention keys/values or linear attention's state, the RNN's states);
  the rest is per sentence."""
  follow = lambda entries: {name: gather_beams(value, parents) if name.startswith('self_')
                            else value for name, value in entries.items()}
  return {**follow(cache), 'layers': [follow(layer) for layer in cache['layers']]}


def transformer_search_setup(model: Transformer, params: Any, inputs: Array, width: int,
                             max_length: int | None, max_extra_length: int,
                             beam: bool = False) -> tuple[StepFn, Any, dict[str, Any]]:
  """The step function, initial cache and search settings to decode `inputs` with `model`.

  Encodes the source (once per sentence) and builds the cache for `width` hypotheses per
  sentence. Returns (step_fn, cache, settings): settings holds batch_size, max_length,
  length_limits and, per `config.cpu_tuned`, the hooks (with `beam`: `reorder_cache` and
  `top_k_extensions`; `chunk_length`, `grow_cache`). CPU-tuned beam search pairs a step
  function returning logits with a top-k hook that normalises only the blocks it selects.
  """
  config = model.config
  inputs = jnp.asarray(inputs)
  if max_length is None:
    max_length = min(inputs.shape[1] + max_extra_length, config.max_len)
  if max_length > config.max_len:
    raise ValueError(f'max_length={max_length} output tokens exceed the positional table '
                     f'(TransformerConfig.max_len={config.max_len}).')
  source_lengths = jnp.sum(inputs != PAD_ID, axis=1, dtype=jnp.int32)
  # An empty source (a batch's padding row) gives EOS at once instead of running with the rest.
  limits = jnp.where(source_lengths > 0, source_lengths + max_extra_length, 1)
  settings = dict(batch_size=inputs.shape[0], max_length=max_length,
                  length_limits=jnp.minimum(limits, max_length))
  variables = {'params': params}
  cpu_cache = config.use_cpu_decoding  # cpu_decoding's cache (not with linear attention).
  cache_length = min(cpu_decoding.CHUNK_LENGTH, max_length) if cpu_cache else max_length
  cache = model.apply(variables, inputs, method=lambda m, x: m.init_decode_cache(
      m.encode(x), x, width, cache_length))
  if cpu_cache:
    cache = cpu_decoding.barrier(cache)
    settings.update(chunk_length=cpu_decoding.CHUNK_LENGTH, grow_cache=cpu_decoding.grow_cache)
  if beam:
    settings.update(reorder_cache=(cpu_decoding.reorder_cache if cpu_cache
                                   else reorder_transformer_cache))
  logits_only = config.use_cpu_tuned and beam
  if logits_only:
    settings.update(top_k_extensions=functools.partial(cpu_decoding.block_top_k_extensions,
                                                       from_logits=True))

  def step_fn(tokens, step, cache):
    logits, cache = model.apply(variables, tokens, step, cache, method='decode_step')
    return (logits if logits_only else jax.nn.log_softmax(logits, axis=-1)), cache

  return step_fn, cache, settings


def transformer_beam_search(model: Transformer, params: Any, inputs: Array, *,
                            beam_size: int = 4, alpha: float = 0.6,
                            max_length: int | None = None, max_extra_length: int = 50,
                            nbest: int = 1, force_full_length: bool = False,
                            stopping: str = 'exact', token_log_probs: bool = False,
                            prefix: Array | None = None,
                            min_length: int = 1) -> tuple[Array, ...]:
  """`beam_search` over a Transformer's translations of `inputs` [batch, src_len] (0-padded).

  max_length: static output length; default min(src_len + max_extra_length, config.max_len).
  Sentence i produces at most min(source_length_i + max_extra_length, max_length) tokens; an
  all-padding row gives EOS alone. min_length: the fewest tokens before EOS of a nonempty
  source (1: never an empty translation). stopping, token_log_probs, prefix: see
  `beam_search`.
  Returns sequences [batch, nbest, max_length] int32 and scores [batch, nbest] float32 (and
  with token_log_probs each token's log-probability [batch, nbest, max_length] float32).
  """
  step_fn, cache, settings = transformer_search_setup(
      model, params, inputs, beam_size, max_length, max_extra_length, beam=True)
  return beam_search(step_fn, cache, beam_size=beam_size, alpha=alpha, nbest=nbest,
                     force_full_length=force_full_length, stopping=stopping,
                     token_log_probs=token_log_probs, prefix=prefix, min_length=min_length,
                     **settings)


def transformer_greedy_search(model: Transformer, params: Any, inputs: Array, *,
                              max_length: int | None = None, max_extra_length: int = 50,
                              force_full_length: bool = False,
                              min_length: int = 1) -> tuple[Array, Array]:
  """`greedy_search` over a Transformer; arguments as `transformer_beam_search`.

  Returns sequences [batch, max_length] int32 and summed log-probabilities [batch] float32.
  """
  step_fn, cache, settings = transformer_search_setup(
      model, params, inputs, 1, max_length, max_extra_length)
  return greedy_search(step_fn, cache, force_full_length=force_full_length,
                       min_length=min_length, **settings)


def transformer_sample(model: Transformer, params: Any, inputs: Array, rng: Array, *,
                       num_samples: int = 1, temperature: float = 1.0, top_k: int = 0,
                       top_p: float = 1.0, max_length: int | None = None,
                       max_extra_length: int = 50, force_full_length: bool = False,
                       min_length: int = 1) -> tuple[Array, Array]:
  """`sample` over a Transformer; arguments as `sample` and `transformer_beam_search`.

  Returns sequences [batch, num_samples, max_length] int32 and their model log-probabilities
  [batch, num_samples] float32.
  """
  step_fn, cache, settings = transformer_search_setup(
      model, params, inputs, num_samples, max_length, max_extra_length)
  return sample(step_fn, cache, rng, num_samples=num_samples, temperature=temperature,
                top_k=top_k, top_p=top_p, force_full_length=force_full_length,
                min_length=min_length, **settings)
