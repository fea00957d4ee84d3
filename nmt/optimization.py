"""One optimizer update, jitted over the mesh: the paper's Adam and learning-rate schedule, the
label-smoothed loss on packed rows, gradient accumulation, skipped non-finite updates and the
parameters' moving average."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from model import UNK_ID, Transformer
from nmt import sharding


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """The paper's rate: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) * scale, step from 1
  (the RNN's hidden_dim in place of d_model); with `optimizer.cooldown_fraction` = f > 0, the
  last C = round(f * num_train_steps) steps of the run scale it down linearly, to 0 after step
  num_train_steps (a fraction, so a run shortened by --config.num_train_steps keeps its shape).
  """
  width = config.model.d_model if 'd_model' in config.model else config.model.hidden_dim
  scale = config.optimizer.learning_rate_scale * width**-0.5
  warmup = config.optimizer.warmup_steps
  cooldown = cooldown_steps(config)
  last_step = config.num_train_steps

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    rate = scale * jnp.minimum(step**-0.5, step * warmup**-1.5)
    if cooldown:
      rate *= jnp.clip((last_step + 1 - step) / cooldown, 0.0, 1.0)
    return rate
  return schedule


def cooldown_steps(config: ml_collections.ConfigDict) -> int:
  """How many of the run's last steps the cooldown takes (0: the paper's schedule to the end)."""
  return round(config.optimizer.get('cooldown_fraction', 0.0) * config.num_train_steps)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Adam (beta 0.9/0.98, eps 1e-9), optional global-norm clipping and decoupled weight decay.

  Clipping applies to the raw gradients, before Adam. Weight decay (AdamW's; the default
  recipe's 0.1, none in the paper) applies to matrices (kernels, embeddings), not to biases or
  LayerNorm scales.
  """
  c = config.optimizer
  # No mask without decay: a mask changes the optimizer state's tree, which a checkpoint must fit.
  matrices_only = ((lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params))
                   if c.weight_decay > 0 else None)
  adam = optax.adamw(learning_rate_schedule(config), b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps,
                     weight_decay=c.weight_decay, mask=matrices_only)
  if c.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(c.grad_clip_norm), adam)
  return adam


def _is_schedule_state(x) -> bool:
  return isinstance(x, optax.ScaleByScheduleState)


def schedule_count(opt_state: Any) -> jax.Array:
  """The step count the learning-rate schedule reads from the optimizer state."""
  return next(s.count for s in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_schedule_state)
              if _is_schedule_state(s))


def advance_schedule(opt_state: Any) -> Any:
  """The optimizer state with only its schedule's count advanced (a skipped update)."""
  return jax.tree_util.tree_map(
      lambda s: s._replace(count=s.count + 1) if _is_schedule_state(s) else s, opt_state,
      is_leaf=_is_schedule_state)


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                  label_smoothing: float) -> dict[str, jax.Array]:
  """Sums over tokens of label-smoothed loss, plain NLL and correct predictions.

  The smoothed loss puts 1 - label_smoothing on the target and spreads the rest evenly over
  the other tokens, minus that distribution's entropy (so a perfect model scores 0).
  Args:
    logits: [batch, length, vocab] float32.
    targets: [batch, length] int; ids the logits do not score (a model whose output layer
      covers the training targets' pieces, `TransformerConfig.output_vocab_size`, on other
      text) count as UNK.
    weights: [batch, length] float, 1 for real tokens and 0 for padding.
  """
  vocab = logits.shape[-1]
  targets = jnp.where(targets < vocab, targets, UNK_ID)
  # log p = logits - logsumexp: the sums below need only logsumexp, the target logit and the
  # sum of logits, so the [batch, length, vocab] log-probabilities are never materialised.
  log_normaliser = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = log_normaliser - target_logit
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1)
  # Equivalent to the cross-entropy against smoothed one-hot targets without building them.
  smoothed = (confidence - low) * nll - low * (logits.sum(-1) - vocab * log_normaliser)
  if label_smoothing > 0:
    smoothed -= -(confidence * math.log(confidence) + (vocab - 1) * low * math.log(low))
  # Correct when the target's logit is the largest (a tie counts as correct): a max reduce
  # instead of argmax, which XLA:CPU lowers to a slower variadic reduce.
  correct = (target_logit >= jnp.max(logits, axis=-1)).astype(jnp.float32)
  return {'loss': (smoothed * weights).sum(), 'nll': (nll * weights).sum(),
          'correct': (correct * weights).sum(), 'tokens': weights.sum()}


def init_train_state(model: Transformer, optimizer: optax.GradientTransformation,
                     rng: jax.Array, ema: bool = False) -> dict[str, Any]:
  """Step 0: fresh parameters, optimizer state, the run's RNG and the skip counters; with
  `ema`, the moving average of the parameters ('ema_params', starting at them)."""
  dummy = jnp.ones((1, 8), jnp.int32)
  params = model.init(rng, dummy, dummy)['params']
  state = {'step': jnp.zeros((), jnp.int32), 'params': params,
           'opt_state': optimizer.init(params), 'rng': rng,
           'nonfinite_in_a_row': jnp.zeros((), jnp.int32),
           'nonfinite_total': jnp.zeros((), jnp.int32)}
  if ema:
    state['ema_params'] = jax.tree_util.tree_map(jnp.copy, params)
  return state


def ema_update(ema_params: Any, params: Any, step: jax.Array, decay: float) -> Any:
  """The moving average after `step` (counted from 1) updates: decay ramps up as
  min(decay, (1 + step) / (10 + step)), so early averages are not dominated by the random
  initial parameters."""
  step = step.astype(jnp.float32)
  rate = jnp.minimum(decay, (1 + step) / (10 + step))
  return jax.tree_util.tree_map(lambda e, p: rate * e + (1 - rate) * p, ema_params, params)


def training_loss(params: Any, batch: dict[str, jax.Array], rng: jax.Array, *,
                  model: Transformer, label_smoothing: float,
                  rdrop_alpha: float = 0.0) -> tuple[jax.Array, dict]:
  """Summed label-smoothed loss of a packed batch with dropout on, and all the loss sums.

  With `rdrop_alpha` > 0, R-Drop (Liang et al. 2021): two forward passes with different
  dropout; every sum is the two passes' mean, and the loss adds rdrop_alpha * (KL(p1 || p2) +
  KL(p2 || p1)) / 4 per real token, the R-Drop code's loss per token of its doubled batch (so
  its alphas carry over).
  """
  weights = (batch['targets'] > 0).astype(jnp.float32)

  def forward(key):
    return model.apply(
        {'params': params}, batch['inputs'], batch['targets'],
        inputs_segmentation=batch['inputs_segmentation'],
        targets_segmentation=batch['targets_segmentation'],
        inputs_positions=batch['inputs_positions'],
        targets_positions=batch['targets_positions'], train=True, rngs={'dropout': key})

  if not rdrop_alpha:
    sums = cross_entropy(forward(rng), batch['targets'], weights, label_smoothing)
    return sums['loss'], sums
  # Two applies rather than one on a doubled batch: each device keeps its own rows.
  logits = [forward(jax.random.fold_in(rng, i)) for i in range(2)]
  passes = [cross_entropy(x, batch['targets'], weights, label_smoothing) for x in logits]
  sums = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, *passes)
  log_p, log_q = (jax.nn.log_softmax(x.astype(jnp.float32)) for x in logits)
  symmetric_kl = jnp.sum((jnp.exp(log_p) - jnp.exp(log_q)) * (log_p - log_q), axis=-1)
  sums['loss'] = sums['loss'] + rdrop_alpha / 4 * jnp.sum(symmetric_kl * weights)
  return sums['loss'], sums


def train_step(state: dict[str, Any], batch: dict[str, jax.Array], *, model: Transformer,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule,
               label_smoothing: float, grad_accum_steps: int,
               ema_decay: float = 0.0, rdrop_alpha: float = 0.0
               ) -> tuple[dict[str, Any], dict[str, jax.Array]]:
  """One optimizer update on a global batch [batch, length]; gradient accumulation inside.

  The loss is normalised by the number of real target tokens of the whole batch, so
  accumulating over micro-batches gives the same update as one big batch. A non-finite loss
  or gradient skips the update and is counted; the schedule advances anyway, so the learning
  rate always follows the step.
  """
  step_rng = jax.random.fold_in(state['rng'], state['step'])
  grad_fn = jax.grad(functools.partial(training_loss, model=model,
                                       label_smoothing=label_smoothing,
                                       rdrop_alpha=rdrop_alpha), has_aux=True)
  if grad_accum_steps == 1:
    grads, sums = grad_fn(state['params'], batch, step_rng)
  else:
    # Micro-batch i takes rows i, i + k, i + 2k, ...: every device keeps its share of rows.
    micro_batches = jax.tree_util.tree_map(
        lambda x: x.reshape(-1, grad_accum_steps, *x.shape[1:]).swapaxes(0, 1), batch)

    def accumulate(carry, inputs):
      index, micro_batch = inputs
      grads, sums = grad_fn(state['params'], micro_batch, jax.random.fold_in(step_rng, index))
      return jax.tree_util.tree_map(jnp.add, carry, (grads, sums)), None

    zeros = jax.tree_util.tree_map(
        jnp.zeros_like, (state['params'], {k: jnp.zeros((), jnp.float32) for k in
                                           ('loss', 'nll', 'correct', 'tokens')}))
    (grads, sums), _ = jax.lax.scan(
        accumulate, zeros, (jnp.arange(grad_accum_steps), micro_batches))
  tokens = jnp.maximum(sums['tokens'], 1.0)
  grads = jax.tree_util.tree_map(lambda g: g / tokens, grads)
  grad_norm = optax.global_norm(grads)
  # One reduction covers every gradient: a NaN or infinity anywhere makes the norm non-finite
  # (as does a norm that overflows float32, which would make Adam's second moment infinite).
  # The learning rate cannot be what breaks an update: validate_config keeps it finite.
  finite = jnp.isfinite(sums['loss']) & jnp.isfinite(grad_norm)
  learning_rate = schedule(schedule_count(state['opt_state']))

  def apply_update(params, opt_state):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  # A branch rather than a select between old and new state: one pass less over the
  # parameters and both Adam moments.
  new_params, new_opt_state = jax.lax.cond(
      finite, apply_update, lambda params, opt_state: (params, advance_schedule(opt_state)),
      state['params'], state['opt_state'])
  new_state = {
      'step': state['step'] + 1,
      'params': new_params,
      'opt_state': new_opt_state,
      'rng': state['rng'],
      'nonfinite_in_a_row': jnp.where(finite, 0, state['nonfinite_in_a_row'] + 1),
      'nonfinite_total': state['nonfinite_total'] + (~finite).astype(jnp.int32),
  }
  if ema_decay:
    new_state['ema_params'] = ema_update(state['ema_params'], new_params, new_state['step'],
                                         ema_decay)
  metrics = dict(sums, grad_norm=grad_norm, finite=finite, learning_rate=learning_rate,
                 nonfinite_in_a_row=new_state['nonfinite_in_a_row'],
                 nonfinite_total=new_state['nonfinite_total'])
  return new_state, metrics


def compile_train_step(config: ml_collections.ConfigDict, model: Transformer,
                       optimizer: optax.GradientTransformation, mesh: Mesh, shardings: Any):
  """The jitted step over `mesh`: state in `shardings`, batch rows split over every device."""
  batch_sharding = sharding.rows(mesh)
  step_fn = jax.jit(
      functools.partial(train_step, model=model, optimizer=optimizer,
                        schedule=learning_rate_schedule(config),
                        label_smoothing=config.optimizer.label_smoothing,
                        grad_accum_steps=config.optimizer.grad_accum_steps,
                        ema_decay=config.optimizer.ema_decay,
                        rdrop_alpha=config.optimizer.get('rdrop_alpha', 0.0)),
      in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None),
      donate_argnums=(0,))
  return step_fn, batch_sharding
