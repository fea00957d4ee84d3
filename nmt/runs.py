"""A trained run, loaded for decoding: its config, tokenizer and model (`load_run`), its
parameters straight into the layout of the devices at hand (`load_params`), and ensembles of
runs (`load_ensemble`)."""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections
from jax.sharding import Mesh

from model import RNN, Transformer, make_model
from nmt import checkpoints, legacy, sharding
from nmt.tokenizer import Tokenizer, load_tokenizer


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """WORKDIR/config.json, the config the run was trained with (`legacy.upgrade_config`)."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path} not found: --workdir must be a training workdir.')
  with open(path, encoding='utf-8') as f:
    try:
      saved = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
      raise ValueError(f'{path} is not a valid config ({error}).') from None
  return legacy.upgrade_config(saved)


def load_run(workdir: str) -> tuple[ml_collections.ConfigDict, Tokenizer, Transformer | RNN]:
  """The run's config, tokenizer and model: everything decoding needs but the parameters."""
  config = load_config(workdir)
  tokenizer = load_tokenizer(os.path.join(workdir, 'tokenizer.model'))
  return config, tokenizer, make_model(config.model)


def load_params(workdir: str, mesh: Mesh, checkpoint: str | int | None = None,
                average: int = 0) -> tuple[Any, str]:
  """The run's parameters replicated over `mesh`, and where they came from
  (`checkpoints.load_params`), in the current parameter layout (`legacy.upgrade_params`).

  With neither `checkpoint` nor `average`: what the run's recipe decodes, its newest moving
  average of the parameters when the newest checkpoint holds one (`optimizer.ema_decay`), else
  the newest checkpoint's parameters.
  """
  if checkpoint is None and not average and checkpoints.newest_holds_ema(workdir):
    checkpoint = 'ema'
  params, origin = checkpoints.load_params(workdir, checkpoint, average,
                                           target=sharding.replicated(mesh))
  return legacy.upgrade_params(params), origin


def load_ensemble(members: str, weights: str | None, tokenizer: Any, mesh: Any, model: Any,
                  params: Any, origin: str) -> tuple[list, list, str, list[float]]:
  """The --workdir model followed by each of `members` ('RUN', 'RUN:STEP', 'RUN:averaged',
  'RUN:best' or 'RUN:ema', comma-separated), their parameters, where they came from and their
  weights."""
  models, trees, origins = [model], [params], [origin]
  for member in filter(None, (m.strip() for m in members.split(','))):
    run, checkpoint = checkpoints.split_run_checkpoint(member)
    _, member_tokenizer, member_model = load_run(run)
    if member_tokenizer.fingerprint != tokenizer.fingerprint:
      raise ValueError(f'--ensemble member {run} has another tokenizer than --workdir: an '
                       'ensemble needs one vocabulary.')
    member_params, member_origin = load_params(run, mesh, checkpoint)
    models.append(member_model)
    trees.append(member_params)
    origins.append(member_origin)
  try:
    values = [float(w) for w in weights.split(',')] if weights else [1.0] * len(models)
  except ValueError:
    raise ValueError(f'--ensemble_weights {weights}: give comma-separated numbers.') from None
  if len(values) != len(models):
    raise ValueError(f'--ensemble_weights has {len(values)} weights for {len(models)} models '
                     '(--workdir first, then --ensemble).')
  if not all(0 <= w < float('inf') for w in values) or sum(values) <= 0:
    raise ValueError(f'--ensemble_weights must be finite, non-negative and not all 0, got '
                     f'{weights}.')
  return models, trees, 'an ensemble of ' + ', '.join(origins), values
