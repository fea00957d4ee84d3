"""Turns a trained run into something that translates without this project's training stack.

  python export.py --workdir runs/multi30k --format jax --output runs/multi30k/exported \
      [--checkpoint STEP | --checkpoint averaged|best|ema | --average_last N]
  python export.py --workdir runs/multi30k --format ctranslate2 --output runs/multi30k/ct2 \
      [--quantization int8]

--output must be new or empty; --overwrite replaces a folder's contents (it is removed first).

--format jax: a `jax.export` translator (encoder + beam search, the parameters passed as
arguments, a symbolic batch dimension, one program per source-length bucket; for the CPU also
a continuous batching search per bucket) with its parameters and tokenizer; `serving.py`,
copied into the folder, translates with it using only jax, numpy, sentencepiece and flatbuffers
(`pip install jax numpy sentencepiece flatbuffers` wherever the folder goes), with the modules
it imports: an HTTP server that batches requests (a slot pool of continuous batching on the
CPU), with n-best lists, alignments and attention from exported forced decoding, and a page.
--format ctranslate2: a CTranslate2 model folder (`pip install -e '.[ctranslate2]'`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import sys
from typing import Any

import jax
import numpy as np
from absl import app, flags, logging
from flax import traverse_util

from model import (
  EOS_ID,
  PAD_ID,
  UNK_ID,
  Transformer,
  TransformerConfig,
  sinusoidal_table,
  transformer_beam_search,
  transformer_continuous_beam_search,
)
from model.cpu.slot_pool import slot_pool
from model.forced_decoding import forced_decoding
from model.transformer import unit_length
from nmt import checkpoints, console, runs, sharding
from nmt import translator as translator_lib

FLAGS = flags.FLAGS
FORMATS = ('jax', 'ctranslate2')


# Source-length buckets of an exported translator (up to the model's max_len): each is one
# program; a sentence runs in the smallest bucket that holds it.
JAX_BUCKETS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
SERVING = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'serving.py')
# What serving.py imports from its own folder in an export (from `nmt` in a checkout): the
# translator, the HTTP server's batcher and server, the page it shows at GET / (inline HTML,
# CSS and JavaScript; no network access) and decode.py's reading of input lines. Each imports
# only the standard library, jax, numpy, sentencepiece and the others.
SERVING_FILES = tuple(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), 'nmt', name)
    for name in ('serving_translator.py', 'serving_batcher.py', 'serving_http.py',
                 'serving_page.html', 'text_io.py'))
# The slot pool (`pool_*.jax`, CPU exports): sources up to POOL_WIDTH tokens; a step program
# per pool size (the CPU decoding step needs a known number of rows), so that a pool holds about
# as many slots as it has sentences; sentences start in the narrowest of POOL_START_WIDTHS that
# holds them (the encoder's cost grows with its positions).
POOL_WIDTH = 64
POOL_START_WIDTHS = (16, 32, 64)
POOL_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def export_jax(workdir: str, params: Any, output_dir: str, platform: str = 'cpu') -> None:
  """Writes the jax.export translator of the run's model with `params` into output_dir.

  One serialized program per source-length bucket (`translator_{length}.jax`): encoder and
  beam search, the parameters as its first argument (`params.npz`, '/'-joined names), inputs
  [batch, length] int32 with a symbolic batch, outputs (sequences [batch, 1, max_length] int32,
  scores [batch, 1] float32). Beside each, the same search returning the beam_size best
  (`nbest_{length}.jax`: sequences [batch, beam_size, max_length], scores [batch, beam_size])
  and the forced decoding of given translations (`forced_{length}.jax`:
  `model.forced_decoding.forced_decoding` of the parameters, inputs [batch, length] and
  targets [batch, max_length] int32). On the CPU decoding path also one continuous batching
  search per bucket (`continuous_{length}.jax`: the parameters, sources [queue, length] int32
  one sentence per row, how many to decode; outputs [queue, 1, max_length] and [queue, 1]),
  and the slot pool the HTTP server runs (`export_slot_pool`).
  Next to them: tokenizer.model, translator.json (buckets, queue sizes and search settings),
  serving.py, which translates with only jax, numpy, sentencepiece and flatbuffers, and the
  modules and page it imports and serves (SERVING_FILES). `platform`
  ('cpu', 'cuda' or 'tpu') is what the programs run on; only 'cpu' uses the CPU-tuned
  decoding.
  """
  config, _, model = runs.load_run(workdir)
  model = Transformer(dataclasses.replace(model.config, cpu_tuned=platform == 'cpu'))
  decode_config = config.decode
  settings = dict(beam_size=decode_config.beam_size, alpha=decode_config.alpha,
                  max_extra_length=decode_config.max_extra_length,
                  stopping=decode_config.stopping,
                  min_length=decode_config.min_length)
  max_length = min(decode_config.max_length, model.config.max_len)
  buckets = [b for b in JAX_BUCKETS if b < model.config.max_len] + [model.config.max_len]
  abstract_params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                           params)
  batch, = jax.export.symbolic_shape('batch')
  for length in buckets:
    search = functools.partial(transformer_beam_search, model,
                               max_length=min(length + settings['max_extra_length'], max_length),
                               **settings)
    exported = jax.export.export(jax.jit(search), platforms=(platform,))(
        abstract_params, jax.ShapeDtypeStruct((batch, length), np.int32))
    with open(os.path.join(output_dir, f'translator_{length}.jax'), 'wb') as f:
      f.write(exported.serialize())
  export_nbest_and_forced(model, abstract_params, buckets, settings, max_length, output_dir,
                          platform)
  # On the CPU, more sentences than slots decode with continuous batching: per bucket a queue
  # of a fixed number of sentences, one per row (the search packs them for its encoder), of
  # which the first `count` are decoded.
  continuous, pool = {}, {}
  if model.config.use_cpu_decoding:
    pool = export_slot_pool(model, abstract_params, settings, max_length, output_dir, platform)
    continuous = dict(slots=translator_lib.CONTINUOUS_SLOTS, sizes={})
    for length in buckets:
      size = translator_lib.continuous_queue_size(length)
      search = functools.partial(
          transformer_continuous_beam_search, model, slots=translator_lib.CONTINUOUS_SLOTS,
          refill=translator_lib.CONTINUOUS_REFILL,
          max_length=min(length + settings['max_extra_length'], max_length), **settings)
      exported = jax.export.export(jax.jit(search), platforms=(platform,))(
          abstract_params, jax.ShapeDtypeStruct((size, length), np.int32),
          jax.ShapeDtypeStruct((), np.int32))
      with open(os.path.join(output_dir, f'continuous_{length}.jax'), 'wb') as f:
        f.write(exported.serialize())
      continuous['sizes'][str(length)] = size
  flat = traverse_util.flatten_dict(params, sep='/')
  np.savez(os.path.join(output_dir, 'params.npz'), **{k: np.asarray(v) for k, v in flat.items()})
  shutil.copy(os.path.join(workdir, 'tokenizer.model'), output_dir)
  for path in (SERVING, *SERVING_FILES):
    shutil.copy(path, output_dir)
  manifest = dict(buckets=buckets, platform=platform, max_length=max_length,
                  batch_tokens=decode_config.batch_tokens, eos_id=EOS_ID, pad_id=PAD_ID,
                  continuous=continuous, **settings, model=config.model.to_dict(),
                  nbest=settings['beam_size'], pool=pool,
                  forced={str(b): min(b + settings['max_extra_length'], max_length)
                          for b in buckets})
  with open(os.path.join(output_dir, 'translator.json'), 'w', encoding='utf-8') as f:
    json.dump(manifest, f, indent=2)


def export_nbest_and_forced(model: Transformer, abstract_params: Any, buckets: list[int],
                            settings: dict[str, Any], max_length: int, output_dir: str,
                            platform: str) -> None:
  """Writes, per source-length bucket, the beam search returning its beam_size best
  (`nbest_{length}.jax`) and `forced_decoding` (`forced_{length}.jax`, targets as long as the
  bucket's longest translation), each with a symbolic batch."""
  batch, = jax.export.symbolic_shape('batch')
  for length in buckets:
    target_length = min(length + settings['max_extra_length'], max_length)
    search = functools.partial(transformer_beam_search, model, max_length=target_length,
                               **{**settings, 'nbest': settings['beam_size']})
    forced = functools.partial(forced_decoding, model)
    for name, function, shapes in (
        ('nbest', search, [(batch, length)]),
        ('forced', forced, [(batch, length), (batch, target_length)])):
      exported = jax.export.export(jax.jit(function), platforms=(platform,))(
          abstract_params, *(jax.ShapeDtypeStruct(shape, np.int32) for shape in shapes))
      with open(os.path.join(output_dir, f'{name}_{length}.jax'), 'wb') as f:
        f.write(exported.serialize())


def export_slot_pool(model: Transformer, abstract_params: Any, settings: dict[str, Any],
                     max_length: int, output_dir: str, platform: str) -> dict[str, Any]:
  """Writes `model.cpu.slot_pool`'s functions: pool_init.jax (a symbolic number of slots),
  pool_start_{w}.jax for each start width w (a symbolic number of started sentences of up to w
  tokens), and pool_put_{n}.jax and pool_step_{n}.jax for each n of POOL_SIZES; returns their
  settings for the manifest: width (the longest source the pool takes), start_widths, sizes
  and max_length (of its translations)."""
  width = min(POOL_WIDTH, model.config.max_len)
  length = min(width + settings['max_extra_length'], max_length)
  pool = slot_pool(model, settings, width, length)
  n, k = jax.export.symbolic_shape('slots, admitted')
  int32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)
  start_widths = sorted({w for w in POOL_START_WIDTHS if w < width} | {width})
  started = jax.eval_shape(pool['start'], abstract_params, int32(k, width))
  state = lambda size: jax.eval_shape(pool['init'], int32(size))
  programs = [('pool_init', pool['init'], (int32(n),))]
  programs += [(f'pool_start_{w}', pool['start'], (abstract_params, int32(k, w)))
               for w in start_widths]
  programs += [(f'pool_put_{size}', pool['put'], (state(size), started, int32(k)))
               for size in POOL_SIZES]
  programs += [(f'pool_step_{size}', pool['step'], (abstract_params, state(size), int32()))
               for size in POOL_SIZES]
  for name, function, args in programs:
    exported = jax.export.export(jax.jit(function), platforms=(platform,))(*args)
    with open(os.path.join(output_dir, f'{name}.jax'), 'wb') as f:
      f.write(exported.serialize())
  return {'width': width, 'start_widths': start_widths, 'sizes': list(POOL_SIZES),
          'max_length': length}


def export_ctranslate2(workdir: str, params: Any, output_dir: str,
                       quantization: str | None = None) -> None:
  """Writes a CTranslate2 model folder of the run's model with `params` into output_dir.

  The folder holds model.bin, the vocabularies (the sentencepiece pieces in id order; the
  target's stops where the output layer does) and a copy of tokenizer.model. CTranslate2
  starts decoding from piece 0 (our start symbol), adds EOS to each source (as our encoder
  sees it) and reads our positional table as given.
  """
  if importlib.util.find_spec('ctranslate2') is None:
    raise ValueError("--format ctranslate2 needs the ctranslate2 package: pip install -e "
                     "'.[ctranslate2]'")
  _, tokenizer, model = runs.load_run(workdir)
  spec = ctranslate2_spec(model.config, params, tokenizer.pieces())
  spec.optimize(quantization=quantization)
  spec.save(output_dir)
  shutil.copy(os.path.join(workdir, 'tokenizer.model'), output_dir)


def ctranslate2_spec(config: TransformerConfig, params: Any, pieces: list[str]) -> Any:
  """A validated `ctranslate2.specs.TransformerSpec` holding `params` (float32) and the
  vocabulary `pieces` (in id order; PAD_ID's piece starts decoding, EOS_ID's ends it)."""
  import ctranslate2
  if (config.activation, config.attention_probs, config.attention_score,
      config.linear_attention) != ('relu', 'softmax', 'scaled_dot', False):
    raise ValueError(
        f'CTranslate2 runs the paper\'s attention (scaled dot-product, softmax) and ReLU; this '
        f'run has activation {config.activation!r}, attention_probs {config.attention_probs!r}, '
        f'attention_score {config.attention_score!r}, linear_attention '
        f'{config.linear_attention}.')
  specs = ctranslate2.specs
  # ScaleNorm's g * x / ||x|| is CTranslate2's RMSNorm, x / sqrt(mean(x^2) + eps) * gamma, with
  # every gamma g / sqrt(d_model) and eps our floor on ||x||^2 over d_model.
  scale_norm = config.norm == 'scale'
  spec = specs.TransformerSpec.from_config(
      (config.num_encoder_layers, config.num_decoder_layers), config.num_heads,
      pre_norm=config.pre_norm, rms_norm=scale_norm)
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
    if scale_norm:
      target.gamma = np.full(d, f32(ours['scale']) / np.sqrt(d), np.float32)
    else:
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

  # The target side holds the pieces the output layer scores (every one unless
  # config.output_vocab_size says fewer): the decoder reads only pieces it wrote.
  outputs = config.num_outputs
  if config.share_embeddings:
    source_table = target_table = output = f32(params['embed']['embedding'])
    if config.fix_norm:  # The unit-length rows the model uses (FixNorm), written out.
      source_table = target_table = output = np.asarray(
          unit_length(source_table, config.layer_norm_epsilon))
    if outputs < config.vocab_size:
      target_table = output = f32(source_table[:outputs])
  else:
    source_table = f32(params['source_embed']['embedding'])
    target_table = f32(params['target_embed']['embedding'])[:outputs]
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
  if config.pre_norm:  # The final norms of pre-LN stacks.
    norm(spec.encoder.layer_norm, params['encoder']['norm'])
    norm(spec.decoder.layer_norm, params['decoder']['norm'])
  spec.register_source_vocabulary(pieces)
  spec.register_target_vocabulary(pieces[:outputs])
  spec.config.unk_token, spec.config.eos_token = pieces[UNK_ID], pieces[EOS_ID]
  spec.config.bos_token = spec.config.decoder_start_token = pieces[PAD_ID]
  spec.config.add_source_eos = True  # Our encoder sees every source end in EOS.
  spec.config.layer_norm_epsilon = config.layer_norm_epsilon / (d if scale_norm else 1)
  spec.validate()
  return spec


def export(workdir: str, output_dir: str, *, format: str = 'jax', checkpoint: str | None = None,
           average_last: int = 0, quantization: str | None = None,
           platform: str = 'cpu', overwrite: bool = False) -> str:
  """Exports the run's parameters (newest checkpoint, a step, 'averaged' or the last N averaged)
  in `format` into output_dir, new or empty (`overwrite`: its contents are replaced); returns
  where the parameters came from."""
  if format not in FORMATS:
    raise ValueError(f'--format must be one of {FORMATS}, got {format!r}.')
  if quantization and format != 'ctranslate2':
    raise ValueError('--quantization applies to --format ctranslate2 only.')
  if os.path.exists(output_dir) and not os.path.isdir(output_dir):
    raise ValueError(f'--output {output_dir} is a file: name a folder.')
  replace = os.path.isdir(output_dir) and bool(os.listdir(output_dir))
  if replace and not overwrite:  # Writing into it would mix two models' files.
    raise ValueError(f'--output {output_dir} is not empty: name a new folder, or pass '
                     '--overwrite to replace its contents.')
  output, run = os.path.realpath(output_dir), os.path.realpath(workdir)
  if replace and os.path.commonpath([output, run]) == output:
    raise ValueError(f'--output {output_dir} holds the run {workdir}: --overwrite would delete '
                     'it; name another folder.')
  if runs.load_config(workdir).model.get('architecture', 'transformer') != 'transformer':
    raise ValueError(f'{workdir} holds an RNN: export.py exports Transformers (decode.py '
                     'translates with the RNN).')
  mesh = sharding.make_mesh(devices=jax.local_devices()[:1])
  params, origin = runs.load_params(workdir, mesh, checkpoint, average_last)
  params = jax.device_get(params)
  if replace:  # Only now that the parameters loaded: a failed export keeps the old folder.
    shutil.rmtree(output_dir)
  os.makedirs(output_dir, exist_ok=True)
  if format == 'jax':
    export_jax(workdir, params, output_dir, platform)
  else:
    export_ctranslate2(workdir, params, output_dir, quantization)
  return origin


def define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir (config, tokenizer, checkpoints).')
  flags.DEFINE_string('output', None, 'Folder to write the exported model into (new or empty).')
  flags.DEFINE_bool('overwrite', False, 'Replace the contents of a non-empty --output folder.')
  flags.DEFINE_enum('format', 'jax', FORMATS, 'What to export to (jax: serving.py in the folder '
                    'needs jax, numpy, sentencepiece and flatbuffers).')
  flags.DEFINE_string('checkpoint', None, "A step, 'averaged', 'best', 'ema'; unset: the "
                      'newest moving average if the newest checkpoint holds one, else the '
                      'newest checkpoint.')
  flags.DEFINE_integer('average_last', 0, 'Average the newest N checkpoints.', lower_bound=0)
  flags.DEFINE_enum('platform', 'cpu', ['cpu', 'cuda', 'tpu'],
                    'What the exported jax programs run on (--format jax).')
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
                    quantization=FLAGS.quantization, platform=FLAGS.platform,
                    overwrite=FLAGS.overwrite)
  except (OSError, ValueError, checkpoints.DamagedCheckpointError) as error:
    sys.exit(f'error: {error}')
  logging.info('Exported %s as %s to %s.', origin, FLAGS.format, FLAGS.output)


if __name__ == '__main__':
  define_flags()
  app.run(main)
