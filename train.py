"""Trains the Transformer: data-parallel over every device, with checkpoints and live evaluation.

  python train.py --config configs/multi30k.py --workdir runs/multi30k [--config.key=value ...]

Restarting with the same workdir resumes from the newest checkpoint (parameters, optimizer
state, step, RNG and data position). SIGTERM/SIGINT save a checkpoint and exit. On several
hosts, set JAX_COORDINATOR_ADDRESS (or run under a launcher that jax.distributed detects) and
pass --distributed. On Linux with glibc it first restarts itself once with malloc settings that
keep XLA:CPU's per-step buffers mapped (glibc_malloc.py; TRANSFORMER_KEEP_MALLOC=1 turns that off).
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
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags, logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import config_flags

import checkpoints
import input_pipeline
from model import Transformer, TransformerConfig, count_params

FLAGS = flags.FLAGS

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


class ConfigError(ValueError):
  """A user mistake in the config, reported before any compilation."""


# ----------------------------------------------------------------------------- configuration


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> TransformerConfig:
  """The model's architecture from the training config."""
  return TransformerConfig(
      vocab_size=vocab_size, d_model=config.d_model, num_heads=config.num_heads,
      d_ff=config.d_ff, num_encoder_layers=config.num_encoder_layers,
      num_decoder_layers=config.num_decoder_layers, dropout_rate=config.dropout_rate,
      attention_dropout_rate=config.attention_dropout_rate, max_len=config.model_max_len,
      share_embeddings=config.share_embeddings, pre_norm=config.pre_norm,
      positional=config.positional, dtype=DTYPES[config.dtype])


def make_mesh(config: ml_collections.ConfigDict, devices: list | None = None) -> Mesh:
  """A ('data', 'fsdp') mesh over every device; config.mesh_shape like 'data:4,fsdp:2'."""
  devices = jax.devices() if devices is None else devices
  sizes = {'data': -1, 'fsdp': 1}
  if config.mesh_shape:
    for part in config.mesh_shape.split(','):
      name, _, size = part.partition(':')
      if name.strip() not in sizes or not size.strip().lstrip('-').isdigit():
        raise ConfigError(f"mesh_shape must look like 'data:4,fsdp:2', got {config.mesh_shape!r}.")
      sizes[name.strip()] = int(size)
  if sizes['data'] == -1:
    sizes['data'] = len(devices) // sizes['fsdp']
  if sizes['data'] * sizes['fsdp'] != len(devices):
    raise ConfigError(f'mesh_shape {sizes} does not cover the {len(devices)} devices.')
  return Mesh(np.asarray(devices).reshape(sizes['data'], sizes['fsdp']), ('data', 'fsdp'))


def validate_config(config: ml_collections.ConfigDict, mesh: Mesh) -> None:
  """Catches user mistakes with a clear message before anything is compiled."""
  if config.dtype not in DTYPES:
    raise ConfigError(f'dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}.')
  if config.d_model % config.num_heads:
    raise ConfigError(f'd_model={config.d_model} is not divisible by num_heads={config.num_heads}.')
  num_devices = mesh.devices.size
  micro_batch, rest = divmod(config.batch_size, config.grad_accum_steps)
  if rest:
    raise ConfigError(f'batch_size={config.batch_size} is not divisible by '
                      f'grad_accum_steps={config.grad_accum_steps}.')
  if micro_batch % num_devices:
    raise ConfigError(f'batch_size / grad_accum_steps = {micro_batch} rows do not divide over '
                      f'{num_devices} devices; use a multiple of {num_devices}.')
  if config.batch_size % jax.process_count():
    raise ConfigError(f'batch_size={config.batch_size} does not divide over '
                      f'{jax.process_count()} hosts.')
  if config.max_length > config.model_max_len:
    raise ConfigError(f'max_length={config.max_length} exceeds model_max_len='
                      f'{config.model_max_len}.')
  if not 0 < config.learning_rate_scale < float('inf'):
    raise ConfigError(f'learning_rate_scale must be positive and finite, got '
                      f'{config.learning_rate_scale}.')
  for key in ('num_train_steps', 'warmup_steps', 'log_every_steps', 'checkpoint_every_steps',
              'eval_every_steps', 'bleu_every_steps', 'grad_accum_steps'):
    if config[key] <= 0:
      raise ConfigError(f'{key} must be positive, got {config[key]}.')


# ----------------------------------------------------------------------------- optimisation


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """The paper's rate: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) * scale, step from 1."""
  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return (config.learning_rate_scale * config.d_model**-0.5
            * jnp.minimum(step**-0.5, step * config.warmup_steps**-1.5))
  return schedule


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Adam (beta 0.9/0.98, eps 1e-9), optional global-norm clipping and decoupled weight decay.

  Clipping applies to the raw gradients, before Adam. Weight decay (AdamW's, off by default as
  in the paper) applies to matrices (kernels, embeddings), not to biases or LayerNorm scales.
  """
  schedule = learning_rate_schedule(config)
  # No mask when there is no decay: the optimizer state keeps the layout earlier runs saved.
  matrices_only = ((lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params))
                   if config.weight_decay > 0 else None)
  adam = optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                     weight_decay=config.weight_decay, mask=matrices_only)
  if config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam)
  return adam


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
  # sum of logits, so the [batch, length, vocab] log-probabilities are never materialised
  # (a third of a CPU training step went to passes over them).
  log_normaliser = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = log_normaliser - target_logit
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1)
  # Equivalent to the cross-entropy against smoothed one-hot targets without building them.
  smoothed = (confidence - low) * nll - low * (logits.sum(-1) - vocab * log_normaliser)
  if label_smoothing > 0:
    smoothed -= -(confidence * math.log(confidence) + (vocab - 1) * low * math.log(low))
  # Correct when the target's logit is the largest (a tie counts as correct). XLA:CPU's argmax
  # (a variadic reduce) took 25 ms of a 620 ms step; a max reduce is a fraction of that.
  correct = (target_logit >= jnp.max(logits, axis=-1)).astype(jnp.float32)
  return {'loss': (smoothed * weights).sum(), 'nll': (nll * weights).sum(),
          'correct': (correct * weights).sum(), 'tokens': weights.sum()}


BATCH_KEYS = ('inputs', 'targets', 'inputs_segmentation', 'targets_segmentation',
              'inputs_positions', 'targets_positions')


def init_train_state(model: Transformer, optimizer: optax.GradientTransformation,
                     rng: jax.Array) -> dict[str, Any]:
  """Step 0: fresh parameters, optimizer state, the run's RNG and the skip counters."""
  dummy = jnp.ones((1, 8), jnp.int32)
  params = model.init(rng, dummy, dummy)['params']
  return {'step': jnp.zeros((), jnp.int32), 'params': params,
          'opt_state': optimizer.init(params), 'rng': rng,
          'nonfinite_in_a_row': jnp.zeros((), jnp.int32),
          'nonfinite_total': jnp.zeros((), jnp.int32)}


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
               optimizer: optax.GradientTransformation, label_smoothing: float,
               grad_accum_steps: int) -> tuple[dict[str, Any], dict[str, jax.Array]]:
  """One optimizer update on a global batch [batch, length]; gradient accumulation inside.

  The loss is normalised by the number of real target tokens of the whole batch, so
  accumulating over micro-batches gives the same update as one big batch. A non-finite loss
  or gradient skips the update and is counted.
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

  def apply_update(params, opt_state):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  # A branch, not a select between old and new state after the update: that was one more
  # pass over parameters and both Adam moments (about 2% of a CPU step, paired).
  new_params, new_opt_state = jax.lax.cond(
      finite, apply_update, lambda params, opt_state: (params, opt_state),
      state['params'], state['opt_state'])
  new_state = {
      'step': state['step'] + 1,
      'params': new_params,
      'opt_state': new_opt_state,
      'rng': state['rng'],
      'nonfinite_in_a_row': jnp.where(finite, 0, state['nonfinite_in_a_row'] + 1),
      'nonfinite_total': state['nonfinite_total'] + (~finite).astype(jnp.int32),
  }
  metrics = dict(sums, grad_norm=grad_norm, finite=finite,
                 nonfinite_in_a_row=new_state['nonfinite_in_a_row'])
  return new_state, metrics


def compile_train_step(config, model, optimizer, mesh, shardings):
  """The jitted step over `mesh`: state in `shardings`, batch rows split over every device."""
  batch_sharding = NamedSharding(mesh, P(('data', 'fsdp')))
  step_fn = jax.jit(
      functools.partial(train_step, model=model, optimizer=optimizer,
                        label_smoothing=config.label_smoothing,
                        grad_accum_steps=config.grad_accum_steps),
      in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None),
      donate_argnums=(0,))
  return step_fn, batch_sharding


def eval_step(params: Any, batch: dict[str, jax.Array], *, model: Transformer) -> dict:
  """Sums of loss terms (no smoothing) over a padded evaluation batch."""
  logits = model.apply({'params': params}, batch['inputs'], batch['targets'])
  return cross_entropy(logits, batch['targets'], (batch['targets'] > 0).astype(jnp.float32), 0.0)


# ----------------------------------------------------------------------------- sharding


def shard_spec(shape: tuple[int, ...], fsdp_size: int) -> P:
  """Replicated, or (fsdp > 1) split along the largest dimension the fsdp axis divides."""
  if fsdp_size > 1:
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
      if shape[dim] % fsdp_size == 0 and shape[dim] >= fsdp_size:
        spec = [None] * len(shape)
        spec[dim] = 'fsdp'
        return P(*spec)
  return P()


def state_shardings(abstract_state: Any, mesh: Mesh) -> Any:
  fsdp_size = mesh.shape['fsdp']
  return jax.tree_util.tree_map(
      lambda x: NamedSharding(mesh, shard_spec(x.shape, fsdp_size)), abstract_state)


def global_batch(local_batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict:
  """This process's rows -> global arrays split over the mesh (rows over data and fsdp)."""
  return {k: jax.make_array_from_process_local_data(sharding, local_batch[k]) for k in BATCH_KEYS}


def replicated_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict:
  """A batch every process holds in full (evaluation) -> global arrays split over the mesh."""
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
          for k, v in batch.items()}


# ----------------------------------------------------------------------------- evaluation


def evaluation_batches(sources: list[np.ndarray], targets: list[np.ndarray], rows: int,
                       max_length: int) -> list[dict[str, np.ndarray]]:
  """Length-sorted [rows, L] batches of every pair once, L rounded up to a multiple of 16."""
  order = sorted(range(len(sources)), key=lambda i: max(len(sources[i]), len(targets[i])))
  batches = []
  for start in range(0, len(order), rows):
    chunk = order[start:start + rows]
    longest = max(max(len(sources[i]), len(targets[i])) for i in chunk)
    length = min(-(-longest // 16) * 16, max_length)
    batch = {k: np.zeros((rows, length), np.int32) for k in ('inputs', 'targets')}
    for row, i in enumerate(chunk):
      src, tgt = sources[i][:length], targets[i][:length]
      batch['inputs'][row, :len(src)] = src
      batch['targets'][row, :len(tgt)] = tgt
    batches.append(batch)
  return batches


def one_program_in_flight(mesh: Mesh) -> bool:
  """Whether to wait for each multi-device program before dispatching the next.

  Several CPU devices in one process run collectives on a shared thread pool; with more than
  one such program in flight their all-reduces can wait on each other forever (seen with 8
  fake devices on 2 cores). GPUs and TPUs keep asynchronous dispatch.
  """
  return jax.default_backend() == 'cpu' and mesh.devices.size > 1


def evaluate(eval_fn, params, batches, sharding) -> dict[str, float]:
  totals = None
  for batch in batches:
    sums = eval_fn(params, replicated_batch(batch, sharding))
    if one_program_in_flight(sharding.mesh):
      jax.block_until_ready(sums)
    totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
  totals = jax.device_get(totals)
  tokens = max(float(totals['tokens']), 1.0)
  nll = float(totals['nll']) / tokens
  return {'eval_nll': nll, 'eval_perplexity': math.exp(min(nll, 50.0)),
          'eval_accuracy': float(totals['correct']) / tokens}


# ----------------------------------------------------------------------------- logging


class MetricsWriter:
  """metrics.jsonl plus TensorBoard event files, written by process 0 only."""

  def __init__(self, workdir: str):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      from tensorboardX import SummaryWriter  # Only the writing process needs it.
      self.jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a', encoding='utf-8')
      self.tensorboard = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self.enabled:
      return
    self.jsonl.write(json.dumps({'step': step, **metrics}) + '\n')
    self.jsonl.flush()
    for key, value in metrics.items():
      self.tensorboard.add_scalar(key, value, step)
    self.tensorboard.flush()

  def close(self) -> None:
    if self.enabled:
      self.jsonl.close()
      self.tensorboard.close()


def check_nonfinite_streak(step_metrics: list[dict], limit: int, step: int) -> None:
  """Raises FloatingPointError if `limit` steps in a row were skipped as non-finite.

  step_metrics: the fetched metrics of each step since the last check (their
  'nonfinite_in_a_row' counters), so a streak that ended between two checks still counts.
  """
  longest = max((int(m['nonfinite_in_a_row']) for m in step_metrics), default=0)
  if longest >= limit:
    raise FloatingPointError(
        f'{longest} consecutive steps had a non-finite loss or gradient (checked at step {step}; '
        f'the limit, max_consecutive_nonfinite, is {limit}); stopping.')


def format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  return f'{hours}h{rest // 60:02d}m' if hours else f'{rest // 60}m{rest % 60:02d}s'


# ----------------------------------------------------------------------------- the loop


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs (or resumes) training; returns the final state's params and last metrics.

  SIGTERM/SIGINT at any point, data loading and compilation included, end the run after the
  current step with a checkpoint.
  """
  stop_signal = []

  def request_stop(signum, frame):
    del frame
    logging.warning('Received signal %d: saving a checkpoint and stopping.', signum)
    stop_signal.append(signum)

  previous_handlers = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    return _train_and_evaluate(config, workdir, stop_signal)
  finally:
    for sig, handler in previous_handlers.items():
      signal.signal(sig, handler)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                        stop_signal: list[int]) -> dict[str, Any]:
  mesh = make_mesh(config)
  validate_config(config, mesh)
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
      f.write(config.to_json_best_effort(indent=2))

  tokenizer = input_pipeline.load_or_train_tokenizer(config, workdir)
  model = Transformer(model_config(config, tokenizer.vocab_size))
  optimizer = make_optimizer(config)

  init_state = functools.partial(init_train_state, model, optimizer)
  rng = jax.random.PRNGKey(config.seed)
  abstract_state = jax.eval_shape(init_state, rng)
  shardings = state_shardings(abstract_state, mesh)
  state = jax.jit(init_state, out_shardings=shardings)(rng)
  num_params = count_params(state['params'])
  logging.info('Config:\n%s', config)
  logging.info('Model: %s parameters; %s', f'{num_params:,}', model.config)
  logging.info('Mesh: %s over %d devices on %d hosts.', dict(mesh.shape), mesh.devices.size,
               jax.process_count())

  # Resume from the newest good checkpoint: parameters, optimizer state, RNG, step, data position.
  manager = checkpoints.make_manager(workdir, max_to_keep=config.keep_checkpoints)
  abstract = lambda tree: jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
  restored = checkpoints.restore_latest(
      manager, abstract(state['params']), abstract({k: state[k] for k in ('opt_state', 'rng')}))
  data_state = None
  if restored is not None:
    params, optimizer_item, meta = restored
    state.update(params=params, **optimizer_item,
                 step=jnp.asarray(meta['step'], jnp.int32),
                 nonfinite_total=jnp.asarray(meta.get('nonfinite_total', 0), jnp.int32),
                 nonfinite_in_a_row=jnp.asarray(meta.get('nonfinite_in_a_row', 0), jnp.int32))
    data_state = meta['data_state']
    logging.info('Resumed from step %d.', meta['step'])
  start_step = int(state['step'])

  train_iter = input_pipeline.make_train_iterator(
      config, tokenizer, process_index=jax.process_index(), process_count=jax.process_count(),
      state=data_state)
  val_sources, val_targets = input_pipeline.read_split(config, config.eval_split)
  eval_rows = max(mesh.devices.size, 64 // mesh.devices.size * mesh.devices.size)
  eval_batches = evaluation_batches(tokenizer.encode(val_sources), tokenizer.encode(val_targets),
                                    eval_rows, config.model_max_len)

  step_fn, batch_sharding = compile_train_step(config, model, optimizer, mesh, shardings)
  eval_fn = jax.jit(functools.partial(eval_step, model=model),
                    in_shardings=(shardings['params'], batch_sharding))

  writer = MetricsWriter(workdir)
  if start_step == 0:
    writer.write(0, {'num_params': num_params})

  def save(step):
    meta = {'step': step, 'data_state': train_iter.get_state(),
            'nonfinite_total': int(state['nonfinite_total']),
            'nonfinite_in_a_row': int(state['nonfinite_in_a_row'])}
    checkpoints.save(manager, step, state['params'],
                     {k: state[k] for k in ('opt_state', 'rng')}, meta)

  sync_each_step = one_program_in_flight(mesh)
  loop_start = time.time()  # Wall time of this process's loop, evaluation included.
  pending = []  # Per-step device metrics, fetched once per logging interval.
  interval_start, interval_steps = time.time(), 0
  untimed = 0  # Leading entries of `pending` outside the timed interval (the compiling step).
  last_metrics: dict[str, Any] = {}
  step = start_step
  lr_schedule = learning_rate_schedule(config)
  logging.info('Training from step %d to %d.', start_step, config.num_train_steps)
  while step < config.num_train_steps and not stop_signal:
    batch = global_batch(next(train_iter), batch_sharding)
    state, metrics = step_fn(state, batch)
    if sync_each_step:
      jax.block_until_ready(metrics)
    step += 1
    interval_steps += 1
    pending.append(metrics)
    is_log_step = step % config.log_every_steps == 0 or step == config.num_train_steps
    if step == start_step + 1 and not is_log_step:
      # The first step includes tracing and compilation: keep it out of tokens/s and the ETA.
      jax.block_until_ready(metrics)
      logging.info('First step (trace, compile, run): %.1f s.', time.time() - interval_start)
      interval_start, interval_steps, untimed = time.time(), 0, len(pending)

    if is_log_step:
      fetched = jax.device_get(pending)
      pending = []
      elapsed = time.time() - interval_start
      totals = {k: sum(float(m[k]) for m in fetched) for k in ('loss', 'nll', 'correct', 'tokens')}
      tokens = max(totals['tokens'], 1.0)
      timed_tokens = sum(float(m['tokens']) for m in fetched[untimed:])
      untimed = 0
      seconds_per_step = elapsed / interval_steps
      last_metrics = {
          'train_loss': totals['loss'] / tokens, 'train_nll': totals['nll'] / tokens,
          'train_perplexity': math.exp(min(totals['nll'] / tokens, 50.0)),
          'train_accuracy': totals['correct'] / tokens,
          'grad_norm': float(fetched[-1]['grad_norm']),
          'learning_rate': float(lr_schedule(step - 1)),
          'target_tokens_per_second': timed_tokens / elapsed,
          'seconds_per_step': seconds_per_step,
          'nonfinite_skipped_total': int(state['nonfinite_total']),
          'wall_minutes': (time.time() - loop_start) / 60,
      }
      eta = seconds_per_step * (config.num_train_steps - step)
      logging.info('step %d/%d | loss %.3f | nll %.3f | acc %.3f | lr %.2e | %s tok/s | '
                   '%.3f s/step | ETA %s', step, config.num_train_steps,
                   last_metrics['train_loss'], last_metrics['train_nll'],
                   last_metrics['train_accuracy'], last_metrics['learning_rate'],
                   f"{last_metrics['target_tokens_per_second']:,.0f}", seconds_per_step,
                   format_duration(eta))
      writer.write(step, last_metrics)
      try:
        check_nonfinite_streak(fetched, config.max_consecutive_nonfinite, step)
      except FloatingPointError as error:
        manager.wait_until_finished()
        raise FloatingPointError(
            f'{error} The newest checkpoint in {manager.directory} holds the last good '
            'parameters (skipped steps change nothing): lower the learning rate '
            '(learning_rate_scale) or enable grad_clip_norm.') from None
      interval_start, interval_steps = time.time(), 0

    run_eval = step % config.eval_every_steps == 0 or step == config.num_train_steps
    run_bleu = step % config.bleu_every_steps == 0 or step == config.num_train_steps
    if run_eval or run_bleu:
      eval_metrics = {}
      if run_eval:
        eval_metrics.update(evaluate(eval_fn, state['params'], eval_batches, batch_sharding))
      if run_bleu:
        eval_metrics.update(bleu_on_validation(config, model, state['params'], tokenizer,
                                               val_sources, val_targets, mesh))
      logging.info('eval at step %d: %s', step,
                   ', '.join(f'{k} {v:.4g}' for k, v in eval_metrics.items()))
      eval_metrics['wall_minutes'] = (time.time() - loop_start) / 60
      writer.write(step, eval_metrics)
      last_metrics.update(eval_metrics)
      interval_start = time.time()  # Evaluation time is not training throughput.

    if step % config.checkpoint_every_steps == 0 or step == config.num_train_steps:
      save(step)

  if stop_signal and (not manager.all_steps() or manager.latest_step() != step):
    save(step)
  manager.wait_until_finished()
  writer.close()
  train_iter.close()
  if stop_signal:
    logging.warning('Stopped by signal at step %d; rerun the same command to resume.', step)
  return {'state': state, 'metrics': last_metrics, 'step': step, 'stopped': bool(stop_signal)}


def bleu_on_validation(config, model, params, tokenizer, sources, references, mesh) -> dict:
  """sacreBLEU and chrF of beam-search translations of the first validation sentences."""
  import decode  # The one translation path, shared with decode.py.
  count = config.num_eval_bleu_sentences
  hypotheses = decode.translate(model, params, tokenizer, sources[:count], config, mesh=mesh)
  scores = decode.score(hypotheses, references[:count])
  return {f'eval_{k}': v for k, v in scores.items() if not k.endswith('signature')}


def exit_on_unknown_config_key(error: Exception):
  key = str(error).strip('"\'')
  sys.exit(f'error: --config.{key}: the config has no key {key!r} (the config file lists them).')


def define_flags():
  """Command-line flags (defined only when run as a script, so other code can import us)."""
  try:
    # Applies --config.KEY overrides to the default config file already, as well as at parsing.
    config_flags.DEFINE_config_file('config', 'configs/multi30k.py', 'Training config file.')
  except (AttributeError, KeyError) as error:
    exit_on_unknown_config_key(error)
  flags.DEFINE_string('workdir', None, 'Run directory (checkpoints, logs, tokenizer).')
  flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() (multi-host).')


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing (a one-line error for a bad value), and one line for an unknown key too."""
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError) as error:  # ml_collections' error for a missing key.
    exit_on_unknown_config_key(error)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if FLAGS.workdir is None:
    raise app.UsageError('--workdir is required.')
  if FLAGS.distributed:
    jax.distributed.initialize()
  if jax.process_index() != 0:  # One host speaks for the run; the others only warn.
    logging.set_verbosity(logging.WARNING)
  try:
    train_and_evaluate(FLAGS.config, FLAGS.workdir)
  except (ConfigError, input_pipeline.DataError, FileNotFoundError, FloatingPointError) as error:
    logging.error('%s', error)
    sys.exit(f'error: {error}')


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=parse_flags)
