"""Every shim for runs written by earlier versions of the project, in one place.

  * config.json without groups (flat keys) -> the grouped config (`upgrade_config`); grouped
    configs without a decoding setting added later get the value their runs were tuned with;
  * parameter trees with the layers at the top level -> `encoder`/`decoder` groups
    (`upgrade_params`);
  * checkpoints whose meta records no checksums: restored unverified, with a warning
    (`warn_unverified`); `averaged/` folders of the params item alone (`params_only_folder`);
  * data states of the earlier input pipeline, or of another `data.num_shards`: a warning, and
    training data starts a fresh epoch (`upgrade_data_state`).
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections
from absl import logging

# config.json of runs written before the config had groups: old key -> (group, key).
FLAT_KEYS = {
    **{k: ('data', k) for k in (
        'dataset_name', 'data_dir', 'manual_dir', 'source_lang', 'target_lang', 'train_split',
        'eval_split', 'test_split', 'spm_sample_size', 'max_length', 'batch_size',
        'shuffle_buffer')},
    **{k: ('model', k) for k in (
        'vocab_size', 'd_model', 'num_heads', 'd_ff', 'num_encoder_layers', 'num_decoder_layers',
        'dropout_rate', 'attention_dropout_rate', 'share_embeddings', 'pre_norm', 'positional',
        'dtype')},
    'model_max_len': ('model', 'max_len'),
    **{k: ('optimizer', k) for k in (
        'warmup_steps', 'learning_rate_scale', 'adam_b1', 'adam_b2', 'adam_eps', 'weight_decay',
        'grad_clip_norm', 'label_smoothing', 'grad_accum_steps', 'max_consecutive_nonfinite')},
    'eval_every_steps': ('eval', 'every_steps'),
    'bleu_every_steps': ('eval', 'bleu_every_steps'),
    'num_eval_bleu_sentences': ('eval', 'bleu_sentences'),
    'beam_size': ('decode', 'beam_size'),
    'length_penalty_alpha': ('decode', 'alpha'),
    'max_decode_extra_length': ('decode', 'max_extra_length'),
    'max_decode_length': ('decode', 'max_length'),
    'eval_batch_tokens': ('decode', 'batch_tokens'),
    **{k: (None, k) for k in (
        'seed', 'num_train_steps', 'mesh_shape', 'checkpoint_every_steps', 'keep_checkpoints',
        'average_last_checkpoints', 'log_every_steps')},
}


# Decoding settings added after runs were saved: the values those runs decoded with ('exact'
# stopping, the search they were tuned with) or, for min_length, the value that avoids empty
# translations of nonempty sources.
DECODE_DEFAULTS = {'stopping': 'exact', 'min_length': 1}
GROUPS = ('data', 'model', 'optimizer', 'eval', 'decode')


def upgrade_config(saved: dict[str, Any]) -> ml_collections.ConfigDict:
  """A run's saved config.json as a grouped ConfigDict, with every decoding setting present."""
  if 'model' not in saved:
    unknown = sorted(set(saved) - set(FLAT_KEYS))
    if unknown:
      raise ValueError(f'config.json has keys this version does not know: {unknown}. Write it '
                       'again with the groups of configs/multi30k.py (data, model, optimizer, '
                       'eval, decode).')
    grouped: dict[str, Any] = {group: {} for group in GROUPS}
    for key, value in saved.items():
      group, name = FLAT_KEYS[key]
      (grouped if group is None else grouped[group])[name] = value
    saved = grouped
  config = ml_collections.ConfigDict(saved)
  for key, value in DECODE_DEFAULTS.items():
    if key not in config.decode:
      config.decode[key] = value
  return config


def upgrade_params(params: dict[str, Any]) -> dict[str, Any]:
  """A parameter tree with the layers at the top level ('encoder_layers_0', ...,
  'encoder_norm', 'decoder_norm') in the current layout ('encoder': {'layers_0', ..., 'norm'},
  'decoder': ...). Trees in the current layout are returned unchanged."""
  if 'encoder' in params or 'decoder' in params:
    return params
  upgraded: dict[str, Any] = {}
  for name, value in params.items():
    for side in ('encoder', 'decoder'):
      if name.startswith(f'{side}_layers_'):
        upgraded.setdefault(side, {})['layers_' + name[len(f'{side}_layers_'):]] = value
        break
      if name == f'{side}_norm':
        upgraded.setdefault(side, {})['norm'] = value
        break
    else:
      upgraded[name] = value
  return upgraded


def warn_unverified(path: str) -> None:
  """A checkpoint whose meta records no checksums: its arrays cannot be checked."""
  logging.warning('%s records no checksums of its arrays (written by an older version): '
                  'restored unverified.', path)


def params_only_folder(path: str) -> bool:
  """Whether a named checkpoint folder (`averaged/`, `best/`) holds the params item's files
  directly, without a meta item."""
  return not os.path.isdir(os.path.join(path, 'params'))


def upgrade_data_state(state: dict[str, Any] | None, num_shards: int) -> dict[str, Any] | None:
  """A checkpoint's data state if the training pipeline can continue from it, else None (a
  fresh epoch): the earlier pipeline's states ({'epoch', 'batch_in_epoch'} of one stream,
  {'num_streams', 'positions'} of several) and states of another number of shards cannot be
  mapped onto these shards."""
  if not state or (state.get('num_shards') == num_shards and 'shards' in state):
    return state or None
  if 'shards' in state:
    why = f"was written with data.num_shards={state.get('num_shards')}, not {num_shards}"
  elif 'positions' in state or 'epoch' in state:
    why = 'is of the earlier input pipeline (epoch and batch positions)'
  else:
    why = f'is not one this version knows ({sorted(state)})'
  logging.warning("The checkpoint's data state %s: the training data starts a fresh epoch, so "
                  'its order from here differs from an uninterrupted run.', why)
  return None
