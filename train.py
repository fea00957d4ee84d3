"""Trains the Transformer: data-parallel over every device, with checkpoints and live evaluation.

  python train.py --config configs/multi30k.py --workdir runs/multi30k [--config.GROUP.KEY=value]

Restarting with the same workdir resumes from the newest intact checkpoint (parameters,
optimizer state, step, RNG and data position); `--init_params_from=RUN` starts a new workdir
from another run's parameters. SIGTERM/SIGINT save a checkpoint and exit with code 75
(interrupted, resumable). One trainer per workdir (workdir_lock.py). On several
hosts, start the same command on each with --distributed (README: "Running on a cluster").
On the CPU backend it first restarts itself once with malloc settings that keep XLA:CPU's
per-step buffers mapped (glibc_malloc.py).
"""

from __future__ import annotations

if __name__ == '__main__':
  # First, before the heavy imports: this may restart the interpreter (see glibc_malloc.py).
  import glibc_malloc

  glibc_malloc.reexec_with_malloc_settings()

import functools
import json
import math
import os
import signal
import sys
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags, logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from ml_collections import config_flags

import checkpoints
import console
import input_pipeline
import sharding
import translation
import workdir_lock
from model import Transformer, count_params, make_model

FLAGS = flags.FLAGS
# Exit code of a run stopped by SIGTERM/SIGINT after saving a checkpoint: resumable
# (sysexits' EX_TEMPFAIL, "try again later").
EXIT_INTERRUPTED = 75
# eval.keep_best_metric -> (the validation metric it reads, whether higher is better).
BEST_METRICS = {'': (None, True), 'bleu': ('eval_bleu', True), 'chrf': ('eval_chrf', True),
                'loss': ('eval_nll', False)}
BATCH_KEYS = ('inputs', 'targets', 'inputs_segmentation', 'targets_segmentation',
              'inputs_positions', 'targets_positions')


class ConfigError(ValueError):
  """A user mistake in the config, reported before any compilation."""


def validate_config(config: ml_collections.ConfigDict, mesh: Mesh) -> None:
  """Catches user mistakes with a clear message before anything is compiled."""
  try:
    make_model(config.model)
  except (TypeError, ValueError) as error:
    raise ConfigError(f'config.model: {error}') from None
  data, optimizer = config.data, config.optimizer
  for key, value in (('data.batch_size', data.batch_size),
                     ('data.max_length', data.max_length),
                     ('data.spm_sample_size', data.spm_sample_size),
                     ('optimizer.grad_accum_steps', optimizer.grad_accum_steps),
                     ('optimizer.max_consecutive_nonfinite', optimizer.max_consecutive_nonfinite),
                     ('num_train_steps', config.num_train_steps),
                     ('optimizer.warmup_steps', optimizer.warmup_steps),
                     ('log_every_steps', config.log_every_steps),
                     ('checkpoint_every_steps', config.checkpoint_every_steps),
                     ('keep_checkpoints', config.keep_checkpoints),
                     ('average_last_checkpoints', config.average_last_checkpoints),
                     ('eval.every_steps', config.eval.every_steps),
                     ('eval.bleu_every_steps', config.eval.bleu_every_steps),
                     ('decode.beam_size', config.decode.beam_size),
                     ('decode.batch_tokens', config.decode.batch_tokens),
                     ('decode.max_length', config.decode.max_length)):
    if value <= 0:
      raise ConfigError(f'{key} must be positive, got {value}.')
  if config.eval.bleu_sentences < 0:
    raise ConfigError(f'eval.bleu_sentences must be 0 (no BLEU) or more, got '
                      f'{config.eval.bleu_sentences}.')
  if config.decode.beam_size > config.model.vocab_size:
    raise ConfigError(f'decode.beam_size={config.decode.beam_size} exceeds the vocabulary '
                      f'(model.vocab_size={config.model.vocab_size}).')
  if not 0 <= optimizer.label_smoothing < 1:
    raise ConfigError(f'optimizer.label_smoothing must be in [0, 1), got '
                      f'{optimizer.label_smoothing}.')
  micro_batch, rest = divmod(data.batch_size, optimizer.grad_accum_steps)
  if rest:
    raise ConfigError(f'data.batch_size={data.batch_size} is not divisible by '
                      f'optimizer.grad_accum_steps={optimizer.grad_accum_steps}.')
  num_devices = mesh.devices.size
  if micro_batch % num_devices:
    raise ConfigError(f'data.batch_size / grad_accum_steps = {micro_batch} rows do not divide '
                      f'over {num_devices} devices; use a multiple of {num_devices}.')
  try:
    input_pipeline.check_streams(config, jax.process_count())
  except input_pipeline.DataError as error:
    raise ConfigError(str(error)) from None
  if data.max_length > config.model.max_len:
    raise ConfigError(f'data.max_length={data.max_length} exceeds model.max_len='
                      f'{config.model.max_len}.')
  if not 0 < optimizer.learning_rate_scale < float('inf'):
    raise ConfigError(f'optimizer.learning_rate_scale must be positive and finite, got '
                      f'{optimizer.learning_rate_scale}.')
  if not 0 <= optimizer.get('cooldown_steps', 0) <= config.num_train_steps:
    raise ConfigError(f'optimizer.cooldown_steps must be in [0, num_train_steps='
                      f'{config.num_train_steps}] (0: the paper\'s schedule to the end), got '
                      f'{optimizer.cooldown_steps}.')
  if not 0 <= config.get('max_train_minutes', 0) < float('inf'):
    raise ConfigError(f'max_train_minutes must be 0 (no limit) or a positive number of minutes, '
                      f'got {config.max_train_minutes}.')
  if not 0 <= optimizer.ema_decay < 1:
    raise ConfigError(f'optimizer.ema_decay must be in [0, 1) (0: no moving average), got '
                      f'{optimizer.ema_decay}.')
  metric, patience = config.eval.keep_best_metric, config.eval.early_stopping_patience
  if metric not in BEST_METRICS:
    raise ConfigError(f"eval.keep_best_metric must be '' or one of {sorted(BEST_METRICS)[1:]}, "
                      f'got {metric!r}.')
  if metric in ('bleu', 'chrf') and config.eval.bleu_sentences == 0:
    raise ConfigError(f'eval.keep_best_metric={metric!r} needs BLEU evaluations: set '
                      'eval.bleu_sentences > 0.')
  if patience < 0 or (patience and not metric):
    raise ConfigError(f'eval.early_stopping_patience={patience}: give 0 (never stop early), or '
                      'a positive count with eval.keep_best_metric set.')


# ----------------------------------------------------------------------------- optimisation


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """The paper's rate: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) * scale, step from 1
  (the RNN's hidden_dim in place of d_model); with `optimizer.cooldown_steps` = C > 0, the last
  C steps of the run scale it down linearly, to 0 after step num_train_steps."""
  width = config.model.d_model if 'd_model' in config.model else config.model.hidden_dim
  scale = config.optimizer.learning_rate_scale * width**-0.5
  warmup = config.optimizer.warmup_steps
  cooldown = config.optimizer.get('cooldown_steps', 0)
  last_step = config.num_train_steps

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    rate = scale * jnp.minimum(step**-0.5, step * warmup**-1.5)
    if cooldown:
      rate *= jnp.clip((last_step + 1 - step) / cooldown, 0.0, 1.0)
    return rate
  return schedule


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Adam (beta 0.9/0.98, eps 1e-9), optional global-norm clipping and decoupled weight decay.

  Clipping applies to the raw gradients, before Adam. Weight decay (AdamW's, off by default as
  in the paper) applies to matrices (kernels, embeddings), not to biases or LayerNorm scales.
  """
  c = config.optimizer
  # No mask when there is no decay: the optimizer state keeps the layout earlier runs saved.
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
    targets: [batch, length] int.
    weights: [batch, length] float, 1 for real tokens and 0 for padding.
  """
  vocab = logits.shape[-1]
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
                  model: Transformer, label_smoothing: float) -> tuple[jax.Array, dict]:
  """Summed label-smoothed loss of a packed batch with dropout on, and all the loss sums."""
  logits = model.apply(
      {'params': params}, batch['inputs'], batch['targets'],
      inputs_segmentation=batch['inputs_segmentation'],
      targets_segmentation=batch['targets_segmentation'],
      inputs_positions=batch['inputs_positions'],
      targets_positions=batch['targets_positions'], train=True, rngs={'dropout': rng})
  sums = cross_entropy(logits, batch['targets'], (batch['targets'] > 0).astype(jnp.float32),
                       label_smoothing)
  return sums['loss'], sums


def train_step(state: dict[str, Any], batch: dict[str, jax.Array], *, model: Transformer,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule,
               label_smoothing: float, grad_accum_steps: int,
               ema_decay: float = 0.0) -> tuple[dict[str, Any], dict[str, jax.Array]]:
  """One optimizer update on a global batch [batch, length]; gradient accumulation inside.

  The loss is normalised by the number of real target tokens of the whole batch, so
  accumulating over micro-batches gives the same update as one big batch. A non-finite loss
  or gradient skips the update and is counted; the schedule advances anyway, so the learning
  rate always follows the step.
  """
  step_rng = jax.random.fold_in(state['rng'], state['step'])
  grad_fn = jax.grad(functools.partial(training_loss, model=model,
                                       label_smoothing=label_smoothing), has_aux=True)
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
                 nonfinite_in_a_row=new_state['nonfinite_in_a_row'])
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
                        ema_decay=config.optimizer.ema_decay),
      in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None),
      donate_argnums=(0,))
  return step_fn, batch_sharding


# ----------------------------------------------------------------------------- evaluation


def eval_step(params: Any, batch: dict[str, jax.Array], *, model: Transformer) -> dict:
  """Sums of loss terms (no smoothing) over a padded evaluation batch."""
  logits = model.apply({'params': params}, batch['inputs'], batch['targets'])
  return cross_entropy(logits, batch['targets'], (batch['targets'] > 0).astype(jnp.float32), 0.0)


def evaluate(eval_fn, params: Any, batches: list[dict[str, np.ndarray]],
             mesh: Mesh) -> dict[str, float]:
  """Per-token NLL, perplexity and accuracy of the validation pairs (teacher forcing)."""
  totals = None
  for batch in batches:
    sums = eval_fn(params, sharding.from_host_copy(batch, sharding.rows(mesh)))
    if sharding.one_program_in_flight(mesh):
      jax.block_until_ready(sums)
    totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
  totals = jax.device_get(totals)
  tokens = max(float(totals['tokens']), 1.0)
  nll = float(totals['nll']) / tokens
  return {'eval_nll': nll, 'eval_perplexity': math.exp(min(nll, 50.0)),
          'eval_accuracy': float(totals['correct']) / tokens}


def bleu_on_validation(translator: translation.Translator, params: Any, sources: list[str],
                       references: list[str]) -> dict[str, float]:
  """sacreBLEU and chrF of beam-search translations of validation sentences."""
  scores = translation.score(translator(params, sources), references)
  return {f'eval_{k}': v for k, v in scores.items() if not k.endswith('signature')}


# ----------------------------------------------------------------------------- the loop's helpers


def truncate_metrics(path: str, start_step: int) -> None:
  """Keeps the rows of metrics.jsonl up to `start_step`, where a run resumes: the steps after
  it are computed (and written) again. A row torn by a kill is dropped too."""
  if not os.path.isfile(path):
    return
  kept = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if start_step > 0 and isinstance(row, dict) and row.get('step', 0) <= start_step:
        kept.append(json.dumps(row) + '\n')
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'w', encoding='utf-8') as f:
    f.writelines(kept)
  os.replace(tmp, path)


class MetricsWriter:
  """metrics.jsonl and TensorBoard event files (clu's writer), on process 0 only.

  A run resumed at `start_step` first drops the rows after it, so every step has its rows once.
  """

  def __init__(self, workdir: str, start_step: int = 0):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      from clu import metric_writers  # Only the writing process needs TensorBoard.
      path = os.path.join(workdir, 'metrics.jsonl')
      truncate_metrics(path, start_step)
      self.jsonl = open(path, 'a', encoding='utf-8')
      self.tensorboard = metric_writers.SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self.enabled:
      return
    self.jsonl.write(json.dumps({'step': step, **metrics}) + '\n')
    self.jsonl.flush()
    self.tensorboard.write_scalars(step, metrics)
    self.tensorboard.flush()

  def close(self) -> None:
    if self.enabled:
      self.jsonl.close()
      self.tensorboard.close()


def summarise_interval(fetched: list[dict], timed_from: int, seconds: float) -> dict[str, float]:
  """Training metrics of the steps since the last log line.

  fetched: each step's metrics as host values; steps before `timed_from` (the compiling first
  step) count for the loss but not for tokens/s. seconds: wall time of the timed steps.
  """
  totals = {k: sum(float(m[k]) for m in fetched) for k in ('loss', 'nll', 'correct', 'tokens')}
  tokens = max(totals['tokens'], 1.0)
  timed = fetched[timed_from:]
  return {
      'train_loss': totals['loss'] / tokens, 'train_nll': totals['nll'] / tokens,
      'train_perplexity': math.exp(min(totals['nll'] / tokens, 50.0)),
      'train_accuracy': totals['correct'] / tokens,
      'grad_norm': float(fetched[-1]['grad_norm']),
      'learning_rate': float(fetched[-1]['learning_rate']),
      'target_tokens_per_second': sum(float(m['tokens']) for m in timed) / max(seconds, 1e-9),
      'seconds_per_step': seconds / max(len(timed), 1),
  }


def is_time(step: int, every: int, last_step: int) -> bool:
  """Whether a task that runs every `every` steps (and at the last step) runs at `step`."""
  return step % every == 0 or step == last_step


class TrainingClock:
  """The run's training time: the loop's wall time less validation, summed over resumes (a
  checkpoint's meta carries it as 'train_seconds')."""

  def __init__(self, seconds_before: float = 0.0):
    self.seconds_before = seconds_before
    self.start = time.time()
    self.paused_seconds = 0.0  # Time spent in validation since `start`.
    self.paused_at: float | None = None

  def seconds(self) -> float:
    now = time.time()
    paused = self.paused_seconds + (now - self.paused_at if self.paused_at else 0.0)
    return self.seconds_before + now - self.start - paused

  def minutes(self) -> float:
    return self.seconds() / 60

  def pause(self) -> None:
    """Time from here to resume() does not count."""
    self.paused_at = time.time()

  def resume(self) -> None:
    self.paused_seconds += time.time() - self.paused_at
    self.paused_at = None


def out_of_training_time(clock: TrainingClock, limit_minutes: float, step: int,
                         log_step: bool) -> bool:
  """Whether the run has used its `max_train_minutes` after `step`. With several processes,
  process 0's clock decides, at logging steps only (a broadcast), so all stop together."""
  if not limit_minutes:
    return False
  if jax.process_count() == 1:
    return clock.minutes() >= limit_minutes
  if not log_step:
    return False
  return bool(multihost_utils.broadcast_one_to_all(np.int32(clock.minutes() >= limit_minutes)))


def check_nonfinite_streak(step_metrics: list[dict], limit: int, step: int) -> None:
  """Raises FloatingPointError if `limit` steps in a row were skipped as non-finite.

  step_metrics: the fetched metrics of each step since the last check (their
  'nonfinite_in_a_row' counters), so a streak that ended between two checks still counts.
  """
  longest = max((int(m['nonfinite_in_a_row']) for m in step_metrics), default=0)
  if longest >= limit:
    raise FloatingPointError(
        f'{longest} consecutive steps had a non-finite loss or gradient (checked at step {step}; '
        f'the limit, optimizer.max_consecutive_nonfinite, is {limit}); stopping.')


def restore_or_init(config: ml_collections.ConfigDict, model: Transformer,
                    optimizer: optax.GradientTransformation, mesh: Mesh, workdir: str,
                    init_params_from: str | None = None):
  """The training state on `mesh`: from the newest intact checkpoint, or fresh.

  A fresh state takes its parameters from `init_params_from` when given ('RUN_DIR',
  'RUN_DIR:STEP' or 'RUN_DIR:averaged'; its optimizer state and step start anew).
  Returns (state, its shardings, the restored checkpoint's meta or None when fresh).
  """
  ema = config.optimizer.ema_decay > 0
  init_state = functools.partial(init_train_state, model, optimizer, ema=ema)
  rng = jax.random.PRNGKey(config.seed)
  shardings = sharding.state_shardings(jax.eval_shape(init_state, rng), mesh)
  state = jax.jit(init_state, out_shardings=shardings)(rng)
  optimizer_keys = ('opt_state', 'rng')
  abstract_params = sharding.with_shardings(state['params'], shardings['params'])
  restored = checkpoints.restore_latest(
      workdir, abstract_params,
      sharding.with_shardings({k: state[k] for k in optimizer_keys},
                              {k: shardings[k] for k in optimizer_keys}),
      abstract_ema=abstract_params if ema else None)
  if restored is None:
    if init_params_from:
      run, _, checkpoint = init_params_from.partition(':')
      try:
        state['params'], origin = checkpoints.load_params(run, checkpoint or None,
                                                          target=abstract_params)
      except checkpoints.CheckpointMismatchError as error:
        raise checkpoints.CheckpointMismatchError(
            f'--init_params_from={init_params_from}: its parameters do not fit this config\'s '
            f'model ({error}).') from None
      logging.info('Parameters from %s, %s; fresh optimizer state.', run, origin)
    return state, shardings, None
  if init_params_from:
    logging.warning('%s has checkpoints: resuming them; --init_params_from is ignored.', workdir)
  params, optimizer_item, meta, ema_params = restored
  state.update(params=params, **optimizer_item, step=jnp.asarray(meta['step'], jnp.int32),
               nonfinite_total=jnp.asarray(meta.get('nonfinite_total', 0), jnp.int32),
               nonfinite_in_a_row=jnp.asarray(meta.get('nonfinite_in_a_row', 0), jnp.int32))
  if ema:
    if ema_params is None:
      logging.warning('Checkpoint %d has no moving average (it was saved without '
                      'optimizer.ema_decay): the average starts from its parameters.',
                      meta['step'])
      ema_params = jax.tree_util.tree_map(jnp.copy, params)
    state['ema_params'] = ema_params
  logging.info('Resumed from step %d.', meta['step'])
  return state, shardings, meta


def whole_data_state(train_iter: input_pipeline.TrainIterator) -> dict[str, Any]:
  """The data position of every stream: each process knows its own streams' (the others are
  -1), so with several processes the maximum over processes is the whole state."""
  state = train_iter.get_state()
  if jax.process_count() > 1:
    positions = multihost_utils.process_allgather(np.asarray(state['positions'], np.int64))
    state = dict(state, positions=np.max(positions, axis=0).tolist())
  return state


def copy_tokenizer(source_run: str, workdir: str) -> None:
  """Gives `workdir` the tokenizer of the run its parameters come from (their vocabulary)."""
  source = os.path.join(source_run, 'tokenizer.model')
  target = os.path.join(workdir, 'tokenizer.model')
  if not os.path.isfile(source):
    raise FileNotFoundError(f'{source} not found: --init_params_from must name a training '
                            'workdir.')
  with open(source, 'rb') as f:
    tokenizer = f.read()
  if os.path.isfile(target):
    with open(target, 'rb') as f:
      if f.read() != tokenizer:
        raise ConfigError(f'{target} differs from {source}: parameters from another run need '
                          'its vocabulary; use a new --workdir.')
    return
  if jax.process_index() == 0:
    tmp = f'{target}.tmp{os.getpid()}'
    with open(tmp, 'wb') as f:
      f.write(tokenizer)
    os.replace(tmp, target)


# ----------------------------------------------------------------------------- the loop


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       init_params_from: str | None = None) -> dict[str, Any]:
  """Runs (or resumes) training; returns the final state, step and last metrics.

  SIGTERM/SIGINT at any point, data loading and compilation included, end the run after the
  current step with a checkpoint ('stopped' in the result). With several processes, a signal
  to any of them stops every process after the same step (see StopRequests). A fresh run
  starts from the parameters of `init_params_from` when given (see restore_or_init).
  """
  mesh = sharding.make_mesh(config.mesh_shape)
  validate_config(config, mesh)
  os.makedirs(workdir, exist_ok=True)
  with StopRequests() as stop_requests, workdir_lock.WorkdirLock(workdir):
    # The lock comes before anything else touches the workdir.
    return _train_and_evaluate(config, workdir, mesh, stop_requests, init_params_from)


class StopRequests:
  """SIGTERM and SIGINT, turned into a stop after a step that every process agrees on.

  One process: a signal handler notes the request. Several processes: JAX's preemption
  service (started by jax.distributed.initialize) catches SIGTERM on any process and picks a
  step at which `stop_after(step)` is true on all of them, so every process saves the same
  checkpoint and no process waits in a collective for a peer that has left; SIGINT is passed
  on to it as SIGTERM.
  """

  def __init__(self):
    self.coordinated = jax.process_count() > 1
    self.signals: list[int] = []
    self._previous = {}

  def __enter__(self) -> StopRequests:
    caught = (signal.SIGINT,) if self.coordinated else (signal.SIGTERM, signal.SIGINT)
    self._previous = {s: signal.signal(s, self._handle) for s in caught}
    return self

  def __exit__(self, *exc_info) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, signum, frame) -> None:
    del frame
    if self.coordinated:
      os.kill(os.getpid(), signal.SIGTERM)  # To the preemption service's handler.
      return
    logging.warning('Received signal %d: saving a checkpoint and stopping.', signum)
    self.signals.append(signum)

  def stop_after(self, step: int) -> bool:
    """Whether to stop after `step` (call once per step, steps increasing, on every process)."""
    if not self.coordinated:
      return bool(self.signals)
    if multihost_utils.reached_preemption_sync_point(step):
      logging.warning('A process received SIGTERM or SIGINT: every process saves step %d and '
                      'stops.', step)
      self.signals.append(signal.SIGTERM)
      return True
    return False


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, mesh: Mesh,
                        stop_requests: StopRequests,
                        init_params_from: str | None) -> dict[str, Any]:

  # Model, optimizer, and the state from the newest checkpoint or fresh: before anything in
  # the workdir changes, so a config that does not fit the checkpoints changes nothing.
  model = make_model(config.model)
  optimizer = make_optimizer(config)
  state, shardings, meta = restore_or_init(config, model, optimizer, mesh, workdir,
                                           init_params_from)
  data_state = meta['data_state'] if meta else None
  if init_params_from and meta is None:
    copy_tokenizer(init_params_from.partition(':')[0], workdir)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
      f.write(config.to_json_best_effort(indent=2))
  logging.info('Config written to %s (--verbosity=1 also logs it).',
               os.path.join(workdir, 'config.json'))
  logging.debug('Config:\n%s', config)
  processes = {'process_index': jax.process_index(), 'process_count': jax.process_count()}
  tokenizer = input_pipeline.load_or_train_tokenizer(config, workdir, **processes)
  manager = checkpoints.make_manager(workdir, max_to_keep=config.keep_checkpoints)
  num_params = count_params(state['params'])
  logging.info('Model: %s parameters; %s', f'{num_params:,}', model.config)
  logging.info('Mesh: %s over %d devices on %d hosts.', dict(mesh.shape), mesh.devices.size,
               jax.process_count())
  start_step = int(state['step'])
  # Tokenized streams kept in the workdir: a resume loads them instead of tokenizing again.
  train_iter = input_pipeline.make_train_iterator(
      config, tokenizer, state=data_state, cache_dir=os.path.join(workdir, 'data_cache'),
      **processes)
  val_sources, val_targets = input_pipeline.read_split(config, config.data.eval_split,
                                                       **processes)
  eval_batches = [arrays for _, arrays in input_pipeline.length_batches(
      {'inputs': tokenizer.encode(val_sources), 'targets': tokenizer.encode(val_targets)},
      config.decode.batch_tokens, config.model.max_len, row_multiple=mesh.devices.size,
      length_multiple=16)]
  bleu_count = config.eval.bleu_sentences
  translator = translation.Translator(model, tokenizer, config.decode, mesh)

  step_fn, batch_sharding = compile_train_step(config, model, optimizer, mesh, shardings)
  eval_fn = jax.jit(functools.partial(eval_step, model=model),
                    in_shardings=(shardings['params'], batch_sharding))
  writer = MetricsWriter(workdir, start_step)
  if start_step == 0:
    writer.write(0, {'num_params': num_params})

  # Keep-best and early stopping: the best value of the metric so far, its step, and the
  # evaluations since it improved; saved in every checkpoint's meta.
  best_key, higher_is_better = BEST_METRICS[config.eval.keep_best_metric]
  patience = config.eval.early_stopping_patience
  best = dict((meta or {}).get('best') or {'value': None, 'step': None, 'stale': 0})
  ema = 'ema_params' in state
  if ema:
    logging.info('Keeping a moving average of the parameters (decay %g); validation uses it.',
                 config.optimizer.ema_decay)

  def save(step):
    meta = {'step': step, 'data_state': whole_data_state(train_iter),
            'nonfinite_total': int(state['nonfinite_total']),
            'nonfinite_in_a_row': int(state['nonfinite_in_a_row']), 'best': best,
            'train_seconds': clock.seconds()}
    checkpoints.save(manager, step, state['params'],
                     {k: state[k] for k in ('opt_state', 'rng')}, meta,
                     ema=state['ema_params'] if ema else None)

  last_step = config.num_train_steps
  sync_each_step = sharding.one_program_in_flight(mesh)
  loop_start = time.time()  # Wall time of this process's loop, evaluation included.
  clock = TrainingClock((meta or {}).get('train_seconds', 0.0))
  time_limit = config.get('max_train_minutes', 0)
  pending = []  # Per-step device metrics, fetched once per logging interval.
  interval_start, untimed = time.time(), 0  # untimed: leading `pending` steps (compiling).
  last_metrics: dict[str, Any] = {}
  step = start_step
  logging.info('Training from step %d to %d.', start_step, last_step)
  stopped = stop_requests.stop_after(step)
  early_stopped = bool(patience) and best['stale'] >= patience  # A resumed early stop.
  out_of_time = bool(time_limit) and clock.minutes() >= time_limit  # A resumed one.
  while step < last_step and not stopped and not early_stopped and not out_of_time:
    batch = sharding.from_host_rows(next(train_iter), batch_sharding)
    state, metrics = step_fn(state, batch)
    if sync_each_step:
      jax.block_until_ready(metrics)
    step += 1
    pending.append(metrics)
    log_now = is_time(step, config.log_every_steps, last_step)
    if step == start_step + 1 and not log_now:
      # The first step includes tracing and compilation: keep it out of tokens/s and the ETA.
      jax.block_until_ready(metrics)
      logging.info('First step (trace, compile, run): %.1f s.', time.time() - interval_start)
      interval_start, untimed = time.time(), len(pending)

    if log_now:
      fetched = jax.device_get(pending)
      last_metrics = summarise_interval(fetched, untimed, time.time() - interval_start)
      last_metrics.update(nonfinite_skipped_total=int(state['nonfinite_total']),
                          wall_minutes=(time.time() - loop_start) / 60,
                          train_minutes=clock.minutes())
      pending, untimed = [], 0
      # The loop's own ETA, not clu's ReportProgress: that one reports through work-unit notes
      # and counts compilation and evaluation time in its rate.
      eta = last_metrics['seconds_per_step'] * (last_step - step)
      if time_limit:
        eta = min(eta, max(time_limit - clock.minutes(), 0.0) * 60)
      logging.info('step %d/%d | loss %.3f | nll %.3f | acc %.3f | lr %.2e | %s tok/s | '
                   '%.3f s/step | ETA %s', step, last_step, last_metrics['train_loss'],
                   last_metrics['train_nll'], last_metrics['train_accuracy'],
                   last_metrics['learning_rate'],
                   f"{last_metrics['target_tokens_per_second']:,.0f}",
                   last_metrics['seconds_per_step'], console.format_duration(eta))
      writer.write(step, last_metrics)
      try:
        check_nonfinite_streak(fetched, config.optimizer.max_consecutive_nonfinite, step)
      except FloatingPointError as error:
        manager.wait_until_finished()
        raise FloatingPointError(
            f'{error} The newest checkpoint in {manager.directory} holds the last good '
            'parameters (skipped steps change nothing): lower the learning rate '
            '(optimizer.learning_rate_scale) or enable optimizer.grad_clip_norm.') from None
      interval_start = time.time()

    run_eval = is_time(step, config.eval.every_steps, last_step)
    run_bleu = bleu_count > 0 and is_time(step, config.eval.bleu_every_steps, last_step)
    if run_eval or run_bleu:
      jax.block_until_ready(metrics)  # The steps so far count as training, not validation.
      clock.pause()
      eval_metrics = {}
      evaluated = state['ema_params'] if ema else state['params']
      if run_eval:
        eval_metrics.update(evaluate(eval_fn, evaluated, eval_batches, mesh))
      if run_bleu:
        eval_metrics.update(bleu_on_validation(translator, evaluated,
                                               val_sources[:bleu_count], val_targets[:bleu_count]))
      logging.info('eval at step %d%s: %s', step, ' (moving average)' if ema else '',
                   ', '.join(f'{k} {v:.4g}' for k, v in eval_metrics.items()))
      if best_key in eval_metrics:
        value = eval_metrics[best_key]
        if best['value'] is None or (value > best['value'] if higher_is_better
                                     else value < best['value']):
          best.update(value=value, step=step, stale=0)
          checkpoints.save_params_folder(
              workdir, checkpoints.BEST_DIR, evaluated,
              {'step': step, 'metric': best_key, 'value': value, 'ema': ema})
          logging.info('New best %s %.4g at step %d: saved to %s.', best_key, value, step,
                       os.path.join(workdir, checkpoints.BEST_DIR))
        else:
          best['stale'] += 1
        eval_metrics.update({f'best_{best_key}': best['value'], 'best_step': best['step']})
        early_stopped = bool(patience) and best['stale'] >= patience
      eval_metrics['wall_minutes'] = (time.time() - loop_start) / 60
      clock.resume()
      eval_metrics['train_minutes'] = clock.minutes()
      writer.write(step, eval_metrics)
      last_metrics.update(eval_metrics)
      interval_start = time.time()  # Evaluation time is not training throughput.

    out_of_time = out_of_training_time(clock, time_limit, step, log_now)
    if is_time(step, config.checkpoint_every_steps, last_step) or out_of_time:
      save(step)
    stopped = stop_requests.stop_after(step)

  if (stopped or early_stopped) and (not manager.all_steps() or manager.latest_step() != step):
    save(step)
  manager.wait_until_finished()
  writer.close()
  train_iter.close()
  if stopped:
    logging.warning('Stopped by signal at step %d with a checkpoint; rerun the same command to '
                    'resume (exit code %d).', step, EXIT_INTERRUPTED)
  elif out_of_time:
    logging.info('Stopped at step %d: max_train_minutes=%g reached (%.1f training minutes); '
                 'checkpoints in %s.', step, time_limit, clock.minutes(), manager.directory)
  elif early_stopped:
    logging.info('Stopped early at step %d: no improvement of %s in %d evaluations; best %.4g '
                 'at step %d, in %s.', step, best_key, patience, best['value'], best['step'],
                 os.path.join(workdir, checkpoints.BEST_DIR))
  else:
    logging.info('Done: step %d in %s; checkpoints in %s.', step,
                 console.format_duration(time.time() - loop_start), manager.directory)
  return {'state': state, 'metrics': last_metrics, 'step': step, 'stopped': stopped,
          'early_stopped': early_stopped, 'out_of_time': out_of_time, 'best': best,
          'train_minutes': clock.minutes(), 'translator': translator}


# ----------------------------------------------------------------------------- command line


def exit_on_unknown_config_key(error: Exception):
  key = str(error).strip('"\'').split("'")[0].strip()
  sys.exit(f'error: --config.{key}: the config has no such key (the config file lists them; '
           'keys are grouped, e.g. --config.model.d_model, --config.data.batch_size).')


def define_flags():
  """Command-line flags (defined only when run as a script, so other code can import us)."""
  try:
    # Applies --config.KEY overrides to the default config file already, as well as at parsing.
    config_flags.DEFINE_config_file('config', 'configs/multi30k.py', 'Training config file.')
  except (AttributeError, KeyError) as error:
    exit_on_unknown_config_key(error)
  flags.DEFINE_string('workdir', None, 'Run directory (checkpoints, logs, tokenizer).')
  sharding.define_distributed_flags()
  flags.DEFINE_string('init_params_from', None, 'A fresh run starts from the parameters of '
                      "another run: 'RUN_DIR' (its newest checkpoint), 'RUN_DIR:STEP' or "
                      "'RUN_DIR:averaged'; optimizer state and step start anew (fine-tuning).")


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing (a one-line error for a bad value), and one line for an unknown key too."""
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError) as error:  # ml_collections' error for a missing key.
    exit_on_unknown_config_key(error)


def out_of_space_message(workdir: str) -> str:
  try:
    steps = checkpoints.saved_steps(workdir)
  except FileNotFoundError:
    steps = []
  kept = (f'the checkpoints written before (newest: step {steps[-1]}) are intact' if steps
          else 'no checkpoint had been written')
  return (f'no space left to write in {os.path.abspath(workdir)}: {kept}. Free some space, then '
          'rerun the same command to resume.')


def fail(message: str, at_once: bool = False) -> None:
  """Ends the process with one error line and exit code 1.

  With several processes it leaves at once: a normal exit waits in JAX's shutdown barrier for
  peers that may be waiting for this process elsewhere (five minutes, then an abort). The
  coordination service tells the peers; they stop with an error too.
  """
  logging.error('%s', message)
  sys.stderr.write(f'error: {message}\n')
  sys.stderr.flush()
  if at_once or jax.process_count() > 1:
    os._exit(1)
  sys.exit(1)


def main(argv):
  if len(argv) > 1:
    sys.exit(f'error: unexpected arguments {argv[1:]} (flags take the form --name=value).')
  if FLAGS.workdir is None:
    sys.exit('error: --workdir is required.')
  console.quiet_libraries()
  sharding.initialize_distributed_from_flags()
  translation.use_compilation_cache(FLAGS.workdir)
  if jax.process_index() != 0:  # One host speaks for the run; the others only warn.
    logging.set_verbosity(logging.WARNING)
  try:
    result = train_and_evaluate(FLAGS.config, FLAGS.workdir, FLAGS.init_params_from)
  except (ConfigError, sharding.MeshError, input_pipeline.DataError, FileNotFoundError,
          FloatingPointError, checkpoints.CheckpointMismatchError,
          checkpoints.DamagedCheckpointError, workdir_lock.WorkdirLockedError) as error:
    fail(str(error))
  except Exception as error:  # noqa: BLE001 - a full disk is one line; the rest a traceback.
    if console.is_out_of_space(error):
      # Orbax's writer threads may still hold the failed save: leave without waiting for them.
      fail(out_of_space_message(FLAGS.workdir), at_once=True)
    if jax.process_count() == 1:
      raise
    traceback.print_exc()
    fail(f'process {jax.process_index()} failed: {type(error).__name__}: {error}')
  if result['stopped']:
    sys.exit(EXIT_INTERRUPTED)


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=parse_flags)
