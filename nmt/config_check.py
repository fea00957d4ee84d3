"""A training config checked before anything compiles: every user mistake gets one clear line."""

from __future__ import annotations

import jax
import ml_collections
from jax.sharding import Mesh

from model import make_model
from model.search import STOPPING_RULES, check_alpha, check_min_length
from nmt.keep_best import BEST_METRICS

# Keys that recipes and scripts of earlier versions set, and what replaced them (the command
# line's unknown-key error names them too).
RENAMED_CONFIG_KEYS = {'optimizer.cooldown_steps': 'optimizer.cooldown_fraction, the share of '
                                                   'num_train_steps the cooldown takes (e.g. 0.25)'}


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
  decode = config.decode
  try:
    check_alpha(decode.alpha)
    check_min_length(decode.min_length)
  except ValueError as error:
    raise ConfigError(f'config.decode: {error}') from None
  output_limit = min(decode.max_length, config.model.get('max_len', decode.max_length))
  if decode.min_length >= output_limit:
    raise ConfigError(f'decode.min_length={decode.min_length} must be below the output length '
                      f'limit {output_limit} (decode.max_length, model.max_len).')
  if decode.stopping not in STOPPING_RULES:
    raise ConfigError(f'decode.stopping must be one of {STOPPING_RULES}, got '
                      f'{decode.stopping!r}.')
  if config.model.get('attention_implementation') == 'cudnn' and jax.default_backend() != 'gpu':
    raise ConfigError("model.attention_implementation='cudnn' runs on GPUs only; this run's "
                      f"backend is {jax.default_backend()!r} (leave it unset, or 'xla').")
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
  if data.num_shards < 1 or data.batch_size % data.num_shards:
    raise ConfigError(f'data.batch_size={data.batch_size} rows do not divide over '
                      f'data.num_shards={data.num_shards}; set data.num_shards to a divisor of '
                      f'{data.batch_size}.')
  if data.num_shards % jax.process_count():
    raise ConfigError(f'data.num_shards={data.num_shards} shards do not divide over '
                      f'{jax.process_count()} processes; set data.num_shards to a multiple of '
                      f'{jax.process_count()}.')
  if data.packing_bins < 1 or data.num_workers < 0 or not 0 <= data.bpe_dropout < 1:
    raise ConfigError(f'data.packing_bins must be positive ({data.packing_bins}), '
                      f'data.num_workers 0 or more ({data.num_workers}), data.bpe_dropout in '
                      f'[0, 1) ({data.bpe_dropout}).')
  if not 0 <= data.get('source_token_dropout', 0.0) < 1:
    raise ConfigError(f'data.source_token_dropout must be in [0, 1) (0: off), got '
                      f'{data.source_token_dropout}.')
  if data.get('target_pieces_first'):
    if config.model.get('architecture', 'transformer') != 'transformer':
      raise ConfigError('data.target_pieces_first sizes the Transformer\'s output layer; '
                        'set it to False for this model.architecture.')
    if data.bpe_dropout:
      raise ConfigError('data.bpe_dropout splits targets into pieces beyond the output layer '
                        'that data.target_pieces_first sizes: use one of the two.')
  elif config.model.get('output_vocab_size'):
    raise ConfigError('model.output_vocab_size is set by train.py with data.target_pieces_first '
                      '(the training targets decide it): leave it 0.')
  if data.max_length > config.model.max_len:
    raise ConfigError(f'data.max_length={data.max_length} exceeds model.max_len='
                      f'{config.model.max_len}.')
  if not 0 < optimizer.learning_rate_scale < float('inf'):
    raise ConfigError(f'optimizer.learning_rate_scale must be positive and finite, got '
                      f'{optimizer.learning_rate_scale}.')
  for old_key, new_key in RENAMED_CONFIG_KEYS.items():
    group, leaf = old_key.split('.')
    if leaf in config.get(group, {}):
      raise ConfigError(f'{old_key} is now {new_key}.')
  if not 0 <= optimizer.get('cooldown_fraction', 0.0) <= 1:
    raise ConfigError(f'optimizer.cooldown_fraction must be in [0, 1] (0: the paper\'s schedule '
                      f'to the end), got {optimizer.cooldown_fraction}.')
  if not 0 <= config.get('max_train_minutes', 0) < float('inf'):
    raise ConfigError(f'max_train_minutes must be 0 (no limit) or a positive number of minutes, '
                      f'got {config.max_train_minutes}.')
  if optimizer.get('rdrop_alpha', 0.0) < 0:
    raise ConfigError(f'optimizer.rdrop_alpha must be >= 0 (0: no R-Drop), got '
                      f'{optimizer.rdrop_alpha}.')
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
