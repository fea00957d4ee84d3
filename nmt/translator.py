"""Text in, translations out: the `Translator` runs a run's beam search over length-sorted
batches split over a mesh's devices, each batch shape's program compiled once and reused by
every later call."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import Mesh

from model import (
  EOS_ID,
  PAD_ID,
  Transformer,
  transformer_beam_search,
  transformer_continuous_beam_search,
  transformer_ensemble_beam_search,
)
from model.forced_decoding import forced_decoding
from model.search import STOPPING_RULES, check_alpha
from nmt import batching, console, sharding
from nmt.tokenizer import Tokenizer

# Continuous batching (`model/cpu/continuous_batching.py`): sentences decoded at once, the most
# empty slots refilled per step, and the most source positions one search's queue holds
# (sentences x the longest source: a bound on its packed rows, whose cross-attention keys
# and values the search keeps).
CONTINUOUS_SLOTS = 128
CONTINUOUS_REFILL = 16
CONTINUOUS_QUEUE_TOKENS = 65536


def continuous_queue_size(width: int) -> int:
  """The most sentences a queue of sources up to `width` tokens holds: a power of two, at least
  CONTINUOUS_SLOTS, within CONTINUOUS_QUEUE_TOKENS."""
  return max(CONTINUOUS_SLOTS, 1 << (CONTINUOUS_QUEUE_TOKENS // width).bit_length() - 1)


def continuous_queues(sources: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
  """`sources` (token id arrays) as the queues of continuous batching searches: per search,
  the indices into `sources` of its sentences (longest first) and its queue [size, width]
  (a sentence per row, then rows of padding; width: its longest source rounded up to a
  multiple of 8; size: a power of two of sentences, at least CONTINUOUS_SLOTS, within
  CONTINUOUS_QUEUE_TOKENS), so that few shapes compile."""
  order = np.argsort([-len(x) for x in sources], kind='stable')
  queues, start = [], 0
  while start < len(order):
    width = max(8, -(-len(sources[order[start]]) // 8) * 8)  # The longest left.
    size = min(continuous_queue_size(width),
               max(CONTINUOUS_SLOTS, 1 << (len(order) - start - 1).bit_length()))
    indices = order[start:start + size]
    queue = np.full((size, width), PAD_ID, np.int32)
    for row, i in enumerate(indices):
      queue[row, :len(sources[i])] = sources[i]
    queues.append((indices, queue))
    start += size
  return queues


class Translator:
  """Beam-search translation of text, batched by length and split over a mesh's devices.

  The jitted search is built once: every later call with a source-length bucket seen before
  reuses its compiled program. Results are gathered to every process.

  On one CPU device (the CPU decoding path), a call with more than CONTINUOUS_SLOTS sentences
  and neither an ensemble, target prefixes nor per-token details decodes them with
  continuous batching: the same search per sentence, without the steps a batch spends on
  sentences already done.
  """

  def __init__(self, model: Transformer | list[Transformer], tokenizer: Tokenizer,
               decode_config: ml_collections.ConfigDict, mesh: Mesh, *,
               beam_size: int | None = None, alpha: float | None = None, nbest: int = 1,
               batch_tokens: int | None = None, stopping: str | None = None,
               details: bool = False, weights: list[float] | None = None,
               min_length: int | None = None, attention: bool = False):
    # A list of models is an ensemble: call with a list of their parameters.
    self.models = list(model) if isinstance(model, list | tuple) else None
    model = self.models[0] if self.models else model
    if self.models:
      model = dataclasses.replace(model, config=dataclasses.replace(
          model.config, max_len=min(m.config.max_len for m in self.models)))
    self.model, self.tokenizer, self.mesh = model, tokenizer, mesh
    self.details, self.attention = details, attention
    self._pieces = tokenizer.pieces()
    self._piece_ids = {piece: i for i, piece in enumerate(self._pieces)}
    self.beam_size = beam_size or decode_config.beam_size
    self.alpha = decode_config.alpha if alpha is None else alpha
    check_alpha(self.alpha)
    if not 1 <= self.beam_size <= model.config.vocab_size:
      raise ValueError(f'beam_size must be between 1 and the vocabulary size '
                       f'{model.config.vocab_size}, got {self.beam_size}.')
    if not 1 <= nbest <= self.beam_size:
      raise ValueError(f'nbest must be between 1 and the beam size {self.beam_size}, got {nbest}.')
    self.nbest = nbest
    self.batch_tokens = batch_tokens or decode_config.batch_tokens
    self.max_extra_length = decode_config.max_extra_length
    self.stopping = stopping or decode_config.stopping
    if self.stopping not in STOPPING_RULES:
      raise ValueError(f'stopping must be one of {STOPPING_RULES}, got {self.stopping!r}.')
    self.max_length = min(decode_config.max_length, model.config.max_len)
    self.min_length = decode_config.min_length if min_length is None else min_length
    if not 0 <= self.min_length < self.max_length:
      raise ValueError(f'min_length must be between 0 and {self.max_length - 1} (the output '
                       f'length limit less the end token), got {self.min_length}.')
    self.compiles = 0  # Programs built, traced or loaded (once per batch or queue shape).
    self._rows = sharding.rows(mesh)

    def search(params, inputs, prefix=None, *, max_length):
      settings = dict(beam_size=self.beam_size, alpha=self.alpha, max_length=max_length,
                      max_extra_length=self.max_extra_length, nbest=nbest,
                      stopping=self.stopping, token_log_probs=details, prefix=prefix,
                      min_length=self.min_length)
      if self.models:
        return transformer_ensemble_beam_search(self.models, params, inputs, weights=weights,
                                                **settings)
      return transformer_beam_search(model, params, inputs, **settings)

    self._search = jax.jit(search, static_argnames='max_length',
                           out_shardings=sharding.replicated(mesh))
    def continuous_search(params, queue, count, *, max_length):
      return transformer_continuous_beam_search(
          model, params, queue, count, slots=CONTINUOUS_SLOTS, refill=CONTINUOUS_REFILL,
          beam_size=self.beam_size, alpha=self.alpha, max_length=max_length,
          max_extra_length=self.max_extra_length, nbest=nbest, stopping=self.stopping,
          min_length=self.min_length)

    self._continuous_search = jax.jit(continuous_search, static_argnames='max_length')

    def forced(params, inputs, targets):
      # Per member: token log-probabilities and cross-attention averaged over layers and heads.
      members = [forced_decoding(m, p, inputs, targets) for m, p in
                 zip(self.models, params)] if self.models else [
                     forced_decoding(model, params, inputs, targets)]
      shares = np.asarray(weights or [1.0] * len(members), np.float32)
      shares = shares / shares.sum()
      return (sum(w * lp for w, (lp, _) in zip(shares, members)),
              sum(w * cross.mean(axis=1) for w, (_, cross) in zip(shares, members)))

    self._forced = jax.jit(forced, out_shardings=sharding.replicated(mesh))
    self._continuous = (not self.models and not details and mesh.devices.size == 1 and
                        jax.process_count() == 1 and model.config.use_cpu_decoding)
    # Compiled searches by batch shape; a batch's program compiles in a thread while the
    # batches before it run, so a call with several shapes waits for the first one only.
    self._programs: dict[Any, concurrent.futures.Future] = {}
    self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='compile')

  def _cancel_pending(self) -> None:
    """Drops the queued compiles that have not started (a started one runs to its end)."""
    for key, future in list(self._programs.items()):
      if future.cancel():
        del self._programs[key]

  def _program(self, search: Any, params: Any, args: tuple, in_sharding: Any,
               max_length: int) -> concurrent.futures.Future:
    """search compiled for params and `args` (host arrays or None, placed as `in_sharding`)
    shaped as these are (a future), compiling it if new."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    shapes = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=in_sharding), args)
    key = (id(search), tree, tuple((x.shape, x.dtype, getattr(x, 'sharding', None))
                                   for x in leaves),
           max_length, str(jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), args)))
    if key not in self._programs:
      self._programs[key] = self._compiler.submit(self._compile, search, params, shapes,
                                                  max_length)
    return self._programs[key]

  def _compile(self, search: Any, params: Any, shapes: tuple, max_length: int) -> Any:
    """search traced, lowered and compiled for params and `shapes` (XLA's compilation cache,
    when set, keeps the compiled program for later processes)."""
    self.compiles += 1
    return search.lower(params, *shapes, max_length=max_length).compile()

  def _jobs(self, params: Any, sides: dict[str, list[np.ndarray]], prefixes: bool
            ) -> list[tuple[np.ndarray, concurrent.futures.Future, tuple, Any]]:
    """The searches a call runs: per search, the indices into `sides` of its sentences (in
    the order of its result rows), its compiled program (a future, queued for compiling in
    the order the searches run), its arguments after the parameters and their sharding."""
    longest = self.model.config.max_len - prefixes  # A prefix needs one more.
    inputs = sides['inputs']
    if self._continuous and not prefixes and len(inputs) > CONTINUOUS_SLOTS:
      inputs = batching.truncate(inputs, longest, 'inputs')
      jobs = []
      for indices, queue in continuous_queues(inputs):
        max_length = min(queue.shape[1] + self.max_extra_length, self.max_length)
        args = (queue, np.int32(len(indices)))
        jobs.append((indices, self._program(self._continuous_search, params, args, None,
                                            max_length), args, None))
      return jobs
    jobs = []
    for indices, arrays in batching.length_batches(
        sides, self.batch_tokens, longest, row_multiple=self.mesh.devices.size):
      max_length = min(arrays['inputs'].shape[1] + self.max_extra_length, self.max_length)
      if prefixes:  # Room for the prefix and one token more.
        max_length = min(max(max_length, arrays['inputs'].shape[1] + 1),
                         self.model.config.max_len)
      args = (arrays['inputs'], arrays.get('prefix'))
      jobs.append((indices, self._program(self._search, params, args, self._rows, max_length),
                   args, self._rows))
    return jobs

  def __call__(self, params: Any, sources: list[str], progress: bool = False,
               prefixes: list[str] | None = None
               ) -> list[str] | list[list[str]] | list[list[dict]]:
    """Translations of `sources`, in their order (nbest > 1: a list of nbest per source).

    Empty sources give empty translations; sources longer than the model's maximum are
    truncated with a warning. With `details`, each source gets a list of nbest dicts (none
    for an empty source): text, score (length-penalised, as the search ranks), log_prob,
    tokens (the pieces, EOS included) and token_log_probs (summing to log_prob).
    `prefixes` (aligned with `sources`, '' for none) start the translations: each is decoded
    as given, then continued by the search, and kept verbatim in the text. A prefix is forced
    as the tokenizer splits it: a partly typed last word stays as typed (not completed).
    Details also hold each target token's alignment (`align`) and, with `attention`, the
    cross-attention matrix.
    """
    if prefixes is not None and len(prefixes) != len(sources):
      raise ValueError(f'{len(sources)} sources but {len(prefixes)} target prefixes.')
    token_ids = self.tokenizer.encode(sources)
    outputs: list[Any] = [[] if self.details else [''] * self.nbest for _ in sources]
    nonempty = [i for i, text in enumerate(sources) if text.strip()]
    sides = {'inputs': [token_ids[i] for i in nonempty]}
    if prefixes is not None:
      # Without the EOS the tokenizer adds, and without trailing spaces (a typed "Ein Mann "
      # ends a word; the next word's piece brings its own space) that would be forced as a
      # piece of their own.
      sides['prefix'] = [x[:-1] for x in self.tokenizer.encode(
          [prefixes[i].rstrip() for i in nonempty])]
      self._check_prefixes(nonempty, sides['prefix'])
    jobs = self._jobs(params, sides, prefixes is not None)
    start, done = time.time(), 0
    logged = start
    try:
      for job_index, (indices, program, args, in_sharding) in enumerate(jobs):
        count = len(indices)
        placed = args if in_sharding is None else sharding.from_host_copy(args, in_sharding)
        sequences, *scores = jax.device_get(program.result()(params, *placed))
        self._collect(outputs, [nonempty[i] for i in indices], sequences, scores,
                      None if prefixes is None else [prefixes[nonempty[i]] for i in indices],
                      args[1] if prefixes is not None else None)
        done += count
        if progress and (time.time() - logged >= 10 or job_index == len(jobs) - 1):
          logged = time.time()
          rate = done / (time.time() - start)
          logging.info('translated %d/%d sentences | %.1f sentences/s | ETA %s', done,
                       len(nonempty), rate, console.format_duration((len(nonempty) - done) / rate))
    except BaseException:  # Interrupted: compiles not yet started are dropped, not awaited.
      self._cancel_pending()
      raise
    if self.details:
      self.align(params, [token_ids[i] for i in nonempty], [outputs[i] for i in nonempty])
    return [o[0] for o in outputs] if self.nbest == 1 and not self.details else outputs

  def _collect(self, outputs: list, positions: list[int], sequences: np.ndarray,
               scores: list[np.ndarray], prefixes: list[str] | None,
               prefix_ids: np.ndarray | None) -> None:
    """A batch's search results (rows in the order of `positions`) into outputs[positions]."""
    for row, position in enumerate(positions):
      if self.details:
        outputs[position] = [self._details(sequences[row, k], scores[0][row, k],
                                           scores[1][row, k])
                             for k in range(self.nbest) if np.isfinite(scores[0][row, k])]
      else:
        outputs[position] = [self.tokenizer.decode(s) for s in sequences[row]]
      if prefixes is not None:
        self._keep_prefix(outputs[position], prefixes[row], sequences[row],
                          int(np.sum(prefix_ids[row] != 0)))

  def _check_prefixes(self, lines: list[int], prefix_ids: list[np.ndarray]) -> None:
    """A prefix must hold only pieces the model can output (TransformerConfig.output_vocab_size:
    the pieces of its training targets); lines: each prefix's 0-based line."""
    outputs = getattr(self.model.config, 'output_vocab_size', 0)
    for line, ids in zip(lines, prefix_ids) if outputs else ():
      beyond = ids[ids >= outputs]
      if beyond.size:
        raise ValueError(f'target prefix {line + 1} holds the piece {self._pieces[beyond[0]]!r}, '
                         f'which no training target held: the model\'s output layer does not '
                         f'score it (model.output_vocab_size={outputs}).')

  def _keep_prefix(self, outputs: list, prefix: str, sequences: np.ndarray, length: int) -> None:
    """Each output's text as the prefix verbatim + the detokenized rest of its sequence."""
    if not length:
      return
    for k, output in enumerate(outputs):
      rest = sequences[k, length:]
      first = self._pieces[int(rest[0])] if rest[0] != EOS_ID else ''
      space = ' ' if first.startswith('\u2581') and not prefix.endswith(' ') else ''
      text = prefix + space + self.tokenizer.decode(rest) if rest[0] != EOS_ID else prefix
      if isinstance(output, dict):
        output['text'] = text
      else:
        outputs[k] = text

  def _details(self, sequence: np.ndarray, score: float, token_log_probs: np.ndarray) -> dict:
    length = int(np.argmax(sequence == EOS_ID)) + 1
    pieces = self._pieces
    return {'text': self.tokenizer.decode(sequence), 'score': float(score),
            'log_prob': float(np.sum(token_log_probs[:length])),
            'tokens': [pieces[t] for t in sequence[:length].tolist()],
            'token_log_probs': [float(x) for x in token_log_probs[:length]]}

  def forced(self, params: Any, source_ids: list[np.ndarray],
             target_ids: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Forced decoding (`model.forced_decoding`) of token id pairs, each ending in EOS: per
    pair, each target token's log-probability [tgt_len] and the cross-attention averaged
    over layers and heads [tgt_len, src_len] (an ensemble's: its members' weighted means).
    Pairs longer than the model's maximum are cut, with a warning."""
    results: list[Any] = [None] * len(source_ids)
    longest = self.model.config.max_len
    for indices, arrays in batching.length_batches(
        {'inputs': source_ids, 'targets': target_ids}, self.batch_tokens, longest,
        row_multiple=self.mesh.devices.size):
      placed = sharding.from_host_copy((arrays['inputs'], arrays['targets']), self._rows)
      log_probs, attention = jax.device_get(self._forced(params, *placed))
      for row, i in enumerate(indices):
        target_length = int(np.sum(arrays['targets'][row] != PAD_ID))
        source_length = int(np.sum(arrays['inputs'][row] != PAD_ID))
        results[i] = (log_probs[row, :target_length],
                      attention[row, :target_length, :source_length])
    return results

  def align(self, params: Any, source_ids: list[np.ndarray], details: list[list[dict]]) -> None:
    """Adds to each details dict its target tokens' alignment: 'align', per target token (EOS
    included) the source token (EOS included) it attends to most; with `attention`, also
    'attention', the cross-attention rows [target token][source token]."""
    pairs = [(i, d) for i, nbest in enumerate(details) for d in nbest]
    targets = [np.array([self._piece_ids[p] for p in d['tokens']], np.int32) for _, d in pairs]
    for (_, d), (_, attention) in zip(
        pairs, self.forced(params, [source_ids[i] for i, _ in pairs], targets)):
      d['align'] = [int(j) for j in np.argmax(attention, axis=-1)]
      if self.attention:
        d['attention'] = np.round(attention, 4).tolist()

  def score(self, params: Any, sources: list[str], targets: list[str]) -> list[dict]:
    """The model's scores of given translations (forced decoding), one dict per pair: text,
    log_prob (their sum), tokens (the pieces, EOS included), token_log_probs, align and with
    `attention` the cross-attention rows."""
    if len(sources) != len(targets):
      raise ValueError(f'{len(sources)} sources but {len(targets)} translations to score.')
    source_ids, target_ids = self.tokenizer.encode(sources), self.tokenizer.encode(targets)
    results = []
    for text, ids, (log_probs, attention) in zip(
        targets, target_ids, self.forced(params, source_ids, target_ids)):
      scored = {'text': text, 'log_prob': float(np.sum(log_probs)),
                'tokens': [self._pieces[t] for t in ids[:len(log_probs)].tolist()],
                'token_log_probs': [float(x) for x in log_probs],
                'align': [int(j) for j in np.argmax(attention, axis=-1)]}
      if self.attention:
        scored['attention'] = np.round(attention, 4).tolist()
      results.append(scored)
    return results
