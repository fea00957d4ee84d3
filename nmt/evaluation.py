"""Validation during training: the teacher-forced loss of the validation pairs, and sacreBLEU
and chrF of beam-search translations of the first of them."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import Mesh

from model import Transformer
from nmt import scoring, sharding
from nmt.optimization import cross_entropy
from nmt.tokenizer import Tokenizer
from nmt.translator import Translator


def eval_step(params: Any, batch: dict[str, jax.Array], *, model: Transformer) -> dict:
  """Sums of loss terms (no smoothing) over a padded evaluation batch."""
  logits = model.apply({'params': params}, batch['inputs'], batch['targets'])
  return cross_entropy(logits, batch['targets'], (batch['targets'] > 0).astype(jnp.float32), 0.0)


class Evaluator:
  """The validation metrics a training step is due for.

  Every `eval.every_steps` (and at the last step): per-token NLL, perplexity and accuracy of
  all validation pairs; every `eval.bleu_every_steps`: sacreBLEU and chrF of the first
  `eval.bleu_sentences` sources' translations. Metric names start with 'eval_'.
  """

  def __init__(self, config: ml_collections.ConfigDict, model: Transformer, tokenizer: Tokenizer,
               mesh: Mesh, param_shardings: Any, batches: list[dict[str, np.ndarray]],
               sources: list[str], targets: list[str]):
    """batches: every validation pair once, {'inputs', 'targets'} int32 [rows, length] with
    rows a multiple of the mesh's devices; sources, targets: the validation texts."""
    self.mesh, self.last_step = mesh, config.num_train_steps
    self.every, self.bleu_every = config.eval.every_steps, config.eval.bleu_every_steps
    self.batches = batches
    outputs = getattr(model.config, 'output_vocab_size', 0)
    beyond = sum(int(np.sum(b['targets'] >= outputs)) for b in batches) if outputs else 0
    if beyond:
      logging.info('%d validation target tokens are pieces outside the output layer (no '
                   'training target holds them): the loss counts them as UNK.', beyond)
    self.bleu_sources = sources[:config.eval.bleu_sentences]
    self.bleu_references = targets[:config.eval.bleu_sentences]
    self.translator = Translator(model, tokenizer, config.decode, mesh)
    self._eval_step = jax.jit(functools.partial(eval_step, model=model),
                              in_shardings=(param_shardings, sharding.rows(mesh)))

  def _is_time(self, step: int, every: int) -> bool:
    return step % every == 0 or step == self.last_step

  def due(self, step: int) -> bool:
    return self._is_time(step, self.every) or (
        bool(self.bleu_sources) and self._is_time(step, self.bleu_every))

  def __call__(self, params: Any, step: int) -> dict[str, float]:
    """The metrics due at `step` of `params`."""
    metrics = {}
    if self._is_time(step, self.every):
      metrics.update(self.loss(params))
    if self.bleu_sources and self._is_time(step, self.bleu_every):
      metrics.update(self.bleu(params))
    return metrics

  def loss(self, params: Any) -> dict[str, float]:
    """Per-token NLL, perplexity and accuracy of the validation pairs (teacher forcing)."""
    totals = None
    for batch in self.batches:
      sums = self._eval_step(params, sharding.from_host_copy(batch, sharding.rows(self.mesh)))
      if sharding.one_program_in_flight(self.mesh):
        jax.block_until_ready(sums)
      totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
    totals = jax.device_get(totals)
    tokens = max(float(totals['tokens']), 1.0)
    nll = float(totals['nll']) / tokens
    return {'eval_nll': nll, 'eval_perplexity': math.exp(min(nll, 50.0)),
            'eval_accuracy': float(totals['correct']) / tokens}

  def bleu(self, params: Any) -> dict[str, float]:
    """sacreBLEU and chrF of beam-search translations of the first validation sources."""
    scores = scoring.score(self.translator(params, self.bleu_sources), self.bleu_references)
    return {f'eval_{k}': v for k, v in scores.items() if not k.endswith('signature')}
