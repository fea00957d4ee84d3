"""Turns a trained run into something that translates without this project's training stack.

  python export.py --workdir runs/multi30k --format jax --output runs/multi30k/exported \
      [--checkpoint STEP | --checkpoint averaged | --average_last N]
  python export.py --workdir runs/multi30k --format ctranslate2 --output runs/multi30k/ct2 \
      [--quantization int8]

--format jax: a `jax.export` translator (encoder + beam search, the parameters passed as
arguments, a symbolic batch dimension, one program per source-length bucket) with its
parameters and tokenizer; `serving.py`, copied into the folder, translates with it using only
jax, numpy and sentencepiece.
--format ctranslate2: a CTranslate2 model folder (`pip install -e '.[ctranslate2]'`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from typing import Any

import jax
import numpy as np
from absl import app, flags, logging

import checkpoints
import console
import sharding
import translation
from model import EOS_ID, PAD_ID, UNK_ID, TransformerConfig, sinusoidal_table

FLAGS = flags.FLAGS
FORMATS = ('jax', 'ctranslate2')


def export_jax(workdir: str, params: Any, output_dir: str) -> None:
  """Writes the jax.export translator of the run's model with `params` into output_dir."""
  raise NotImplementedError('--format jax is not built yet.')


def export_ctranslate2(workdir: str, params: Any, output_dir: str,
                       quantization: str | None = None) -> None:
  """Writes a CTranslate2 model folder of the run's model with `params` into output_dir.

  The folder holds model.bin, the shared vocabulary (the sentencepiece pieces in id order) and
  a copy of tokenizer.model. CTranslate2 starts decoding from piece 0 (our start symbol), adds
  EOS to each source (as our encoder sees it) and reads our positional table as given.
  """
  if importlib.util.find_spec('ctranslate2') is None:
    raise ValueError("--format ctranslate2 needs the ctranslate2 package: pip install -e "
                     "'.[ctranslate2]'")
  _, tokenizer, model = translation.load_run(workdir)
  spec = ctranslate2_spec(model.config, params, tokenizer.pieces())
  spec.optimize(quantization=quantization)
  spec.save(output_dir)
  shutil.copy(os.path.join(workdir, 'tokenizer.model'), output_dir)


def ctranslate2_spec(config: TransformerConfig, params: Any, pieces: list[str]) -> Any:
  """A validated `ctranslate2.specs.TransformerSpec` holding `params` (float32) and the
  vocabulary `pieces` (in id order; PAD_ID's piece starts decoding, EOS_ID's ends it)."""
  import ctranslate2
  if config.activation != 'relu' or config.attention_probs != 'softmax':
    raise ValueError(f'CTranslate2 runs ReLU softmax Transformers; this run has activation '
                     f'{config.activation!r}, attention_probs {config.attention_probs!r}.')
  specs = ctranslate2.specs
  spec = specs.TransformerSpec.from_config(
      (config.num_encoder_layers, config.num_decoder_layers), config.num_heads,
      pre_norm=config.pre_norm)
  d = config.d_model
  f32 = lambda x: np.array(x, np.float32)  # A copy: quantization writes into the arrays.
  # Our kernels are [in, out], [d_model, heads, head_dim] (query, key, value) or [heads,
  # head_dim, d_model] (out); CTranslate2's linear weights are [out, in].
  def kernel(dense, inputs=d):
    k = f32(dense['kernel'])
    return k.reshape(inputs, -1).T
  zeros = np.zeros(d, np.float32)

  def bias(dense):
    return f32(dense['bias']).reshape(-1) if 'bias' in dense else zeros

  def linear(target, *denses, inputs=d):  # Several projections fused along the output axis.
    target.weight = np.concatenate([kernel(x, inputs) for x in denses])
    target.bias = np.concatenate([bias(x) for x in denses])

  def norm(target, ours):
    target.gamma, target.beta = f32(ours['scale']), f32(ours['bias'])

  def attention(target, ours, norm_params, cross):
    if cross:
      linear(target.linear[0], ours['query'])
      linear(target.linear[1], ours['key'], ours['value'])
    else:
      linear(target.linear[0], ours['query'], ours['key'], ours['value'])
    linear(target.linear[-1], ours['out'], inputs=config.num_heads * config.head_dim)
    norm(target.layer_norm, norm_params)

  def feed_forward(target, ours, norm_params):
    linear(target.linear_0, ours['hidden'])
    linear(target.linear_1, ours['output'], inputs=config.d_ff)
    norm(target.layer_norm, norm_params)

  if config.share_embeddings:
    source_table = target_table = output = f32(params['embed']['embedding'])
  else:
    source_table = f32(params['source_embed']['embedding'])
    target_table = f32(params['target_embed']['embedding'])
    output = kernel(params['output_projection'])
  if config.positional == 'sinusoidal':  # Room for CTranslate2's longer default length limits.
    positions = sinusoidal_table(max(config.max_len, 1024), d)
  else:
    positions = f32(params['position_embed']['embedding'])
  for stack, table in ((spec.encoder, source_table), (spec.decoder, target_table)):
    embeddings = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
    embeddings.weight = table
    stack.scale_embeddings = True
    stack.position_encodings.encodings = positions
  spec.decoder.projection.weight = output
  for i, layer in enumerate(spec.encoder.layer):
    ours = params['encoder'][f'layers_{i}']
    attention(layer.self_attention, ours['self_attention'],
              ours['self_attention_sublayer']['norm'], cross=False)
    feed_forward(layer.ffn, ours['feed_forward'], ours['feed_forward_sublayer']['norm'])
  for i, layer in enumerate(spec.decoder.layer):
    ours = params['decoder'][f'layers_{i}']
    attention(layer.self_attention, ours['self_attention'],
              ours['self_attention_sublayer']['norm'], cross=False)
    attention(layer.attention, ours['cross_attention'],
              ours['cross_attention_sublayer']['norm'], cross=True)
    feed_forward(layer.ffn, ours['feed_forward'], ours['feed_forward_sublayer']['norm'])
  if config.pre_norm:  # The final LayerNorms of pre-LN stacks.
    norm(spec.encoder.layer_norm, params['encoder']['norm'])
    norm(spec.decoder.layer_norm, params['decoder']['norm'])
  spec.register_source_vocabulary(pieces)
  spec.register_target_vocabulary(pieces)
  spec.config.unk_token, spec.config.eos_token = pieces[UNK_ID], pieces[EOS_ID]
  spec.config.bos_token = spec.config.decoder_start_token = pieces[PAD_ID]
  spec.config.add_source_eos = True  # Our encoder sees every source end in EOS.
  spec.config.layer_norm_epsilon = config.layer_norm_epsilon
  spec.validate()
  return spec


def export(workdir: str, output_dir: str, *, format: str = 'jax', checkpoint: str | None = None,
           average_last: int = 0, quantization: str | None = None) -> str:
  """Exports the run's parameters (newest checkpoint, a step, 'averaged' or the last N averaged)
  in `format`; returns where they came from."""
  if format not in FORMATS:
    raise ValueError(f'--format must be one of {FORMATS}, got {format!r}.')
  if quantization and format != 'ctranslate2':
    raise ValueError('--quantization applies to --format ctranslate2 only.')
  mesh = sharding.make_mesh(devices=jax.local_devices()[:1])
  params, origin = translation.load_params(workdir, mesh, checkpoint, average_last)
  params = jax.device_get(params)
  os.makedirs(output_dir, exist_ok=True)
  if format == 'jax':
    export_jax(workdir, params, output_dir)
  else:
    export_ctranslate2(workdir, params, output_dir, quantization)
  return origin


def define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir (config, tokenizer, checkpoints).')
  flags.DEFINE_string('output', None, 'Folder to write the exported model into.')
  flags.DEFINE_enum('format', 'jax', FORMATS, 'What to export to.')
  flags.DEFINE_string('checkpoint', None, "A step, 'averaged', or the newest if unset.")
  flags.DEFINE_integer('average_last', 0, 'Average the newest N checkpoints.', lower_bound=0)
  flags.DEFINE_enum('quantization', None, ['int8', 'int8_float32', 'int16', 'float16'],
                    'CTranslate2 weight quantization (default: float32).')


def main(argv):
  if len(argv) > 1:
    sys.exit(f'error: unexpected arguments {argv[1:]} (flags take the form --name=value).')
  if not FLAGS.workdir or not FLAGS.output:
    sys.exit('error: --workdir and --output are required.')
  console.quiet_libraries()
  try:
    origin = export(FLAGS.workdir, FLAGS.output, format=FLAGS.format,
                    checkpoint=FLAGS.checkpoint, average_last=FLAGS.average_last,
                    quantization=FLAGS.quantization)
  except (FileNotFoundError, ValueError, checkpoints.DamagedCheckpointError) as error:
    sys.exit(f'error: {error}')
  logging.info('Exported %s as %s to %s.', origin, FLAGS.format, FLAGS.output)


if __name__ == '__main__':
  define_flags()
  app.run(main)
