"""Draws a trained run's attention weights as heatmaps, labelled with the subword pieces.

  python plot_attention.py --workdir runs/multi30k --sentences "A man is riding a bike ." \
      --output_dir runs/multi30k/attention [--input FILE] [--targets "..."] \
      [--checkpoint STEP | --checkpoint averaged|best|ema] [--beam_size 4]

Each sentence is translated (beam search, as decode.py), then the model reads the source and
its translation once more, teacher-forced, recording every attention's weights. Or, with
--targets (one per sentence, '|'-separated as --sentences), the given translations are read
instead (forced alignment). For sentence i, in --output_dir:
  i_cross_attention_layerL.png     decoder-encoder attention of layer L: one panel per head
                                   and their mean (rows: output pieces, columns: source pieces);
  i_encoder_self_attention_layerL.png, i_decoder_self_attention_layerL.png  likewise;
  i_cross_attention_mean.png       the mean over every layer and head;
  i_attention.npz                  the weights [heads, queries, keys] of every attention and
                                   layer, and the pieces.
Works for every attention variant of the config (softmax, sparsemax, entmax15, other scores,
linear attention, whose weights are phi(q).phi(k) normalised) and for the RNN (its one
attention, as i_cross_attention_layer0.png).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from absl import app, flags, logging

from model import EOS_ID, RNN, Transformer
from model.forced_decoding import attention_maps
from nmt import checkpoints, console, runs, sharding, startup, text_io
from nmt import translator as translator_lib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

FLAGS = flags.FLAGS
# Which pieces label each attention's queries and keys.
SIDES = {'encoder_self_attention': ('source', 'source'),
         'decoder_self_attention': ('target', 'target'),
         'cross_attention': ('target', 'source')}


def attention_weights(model: Transformer | RNN, params: Any, inputs: np.ndarray,
                      targets: np.ndarray) -> dict[str, list[np.ndarray]]:
  """Every attention's weights for one sentence pair (`model.forced_decoding.attention_maps`).

  Args:
    inputs: [src_len] source ids (EOS included); targets: [tgt_len] target ids (EOS included).
  Returns:
    {'encoder_self_attention' | 'decoder_self_attention' | 'cross_attention': per layer,
    float32 [heads, queries, keys]} (the RNN: its cross attention only).
  """
  _, maps = attention_maps(model, params, jnp.asarray(inputs)[None], jnp.asarray(targets)[None])
  return {name: [np.asarray(weights[0]) for weights in layers] for name, layers in maps.items()}


def draw(weights: np.ndarray, query_pieces: list[str], key_pieces: list[str], title: str,
         path: str, axis_names: tuple[str, str] = ('queries', 'keys'),
         names: list[str] | None = None) -> None:
  """One PNG: a heatmap per head of weights [heads, queries, keys], and their mean.

  axis_names: what the rows (queries) and columns (keys) are; names: the panels' titles
  (default 'head 0', 'head 1', ..., 'mean')."""
  panels = list(weights) + [weights.mean(axis=0)] if len(weights) > 1 else list(weights)
  names = names or ([f'head {h}' for h in range(len(weights))] +
                    (['mean'] if len(weights) > 1 else []))
  columns = min(len(panels), 3)
  rows = -(-len(panels) // columns)
  size = 0.28 * max(len(query_pieces), len(key_pieces)) + 1.5
  figure, axes = plt.subplots(rows, columns, figsize=(size * columns, size * rows),
                              squeeze=False)
  for axis in axes.flat[len(panels):]:
    axis.axis('off')
  for axis, panel, name in zip(axes.flat, panels, names):
    axis.imshow(panel, cmap='viridis', vmin=0, vmax=max(float(panel.max()), 1e-9),
                aspect='auto', interpolation='nearest')
    axis.set_xticks(range(len(key_pieces)), key_pieces, rotation=90, fontsize=7)
    axis.set_yticks(range(len(query_pieces)), query_pieces, fontsize=7)
    axis.set_title(name, fontsize=9)
    axis.set_ylabel(axis_names[0], fontsize=8)
    axis.set_xlabel(axis_names[1], fontsize=8)
  figure.suptitle(title, fontsize=10)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)


def plot(workdir: str, sentences: list[str], output_dir: str, targets: list[str] | None = None,
         checkpoint: str | None = None, beam_size: int | None = None) -> list[str]:
  """Writes the pictures and weights of each sentence; returns the files written."""
  if targets is not None and len(targets) != len(sentences):
    raise ValueError(f'{len(sentences)} sentences but {len(targets)} targets.')
  if not sentences or not all(s.strip() for s in sentences):
    raise ValueError('give at least one sentence, and no empty ones.')
  config, tokenizer, model = runs.load_run(workdir)
  mesh = sharding.make_mesh()
  params, origin = runs.load_params(workdir, mesh, checkpoint)
  params = jax.device_get(params)
  pieces = tokenizer.pieces()
  piece_ids = {piece: i for i, piece in enumerate(pieces)}
  if targets is None:
    translator = translator_lib.Translator(model, tokenizer, config.decode, mesh,
                                        beam_size=beam_size, details=True)
    best = [outputs[0] for outputs in translator(params, sentences)]
    target_ids = [np.array([piece_ids[p] for p in output['tokens']], np.int32)
                  for output in best]
    logging.info('Translated %d sentences with %s.', len(sentences), origin)
  else:
    target_ids = tokenizer.encode(targets)
  source_ids = tokenizer.encode(sentences)
  longest = max(len(ids) for ids in source_ids + list(target_ids))
  if longest > model.config.max_len:
    raise ValueError(f'a sentence has {longest} pieces, more than the model\'s maximum '
                     f'{model.config.max_len}.')
  os.makedirs(output_dir, exist_ok=True)
  written = []
  for index, (inputs, outputs) in enumerate(zip(source_ids, target_ids, strict=True)):
    labels = {'source': [pieces[t] if t != EOS_ID else '</s>' for t in inputs],
              'target': [pieces[t] if t != EOS_ID else '</s>' for t in outputs]}
    weights = attention_weights(model, params, inputs, outputs)
    prefix = os.path.join(output_dir, f'{index}_')
    for name, (queries, keys) in SIDES.items():
      for layer, layer_weights in enumerate(weights.get(name, [])):
        path = f'{prefix}{name}_layer{layer}.png'
        draw(layer_weights, labels[queries], labels[keys],
             f'{name.replace("_", " ")}, layer {layer}', path, (queries, keys))
        written.append(path)
    mean = np.mean([w.mean(axis=0) for w in weights['cross_attention']], axis=0)
    draw(mean[None], labels['target'], labels['source'], 'cross attention',
         f'{prefix}cross_attention_mean.png', ('target', 'source'),
         ['mean over layers and heads'])
    arrays = {f'{name}_layer{layer}': w for name in weights for layer, w in
              enumerate(weights[name])}
    np.savez(f'{prefix}attention.npz', source_pieces=np.array(labels['source']),
             target_pieces=np.array(labels['target']), **arrays)
    written += [f'{prefix}cross_attention_mean.png', f'{prefix}attention.npz']
  return written


def define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir (config.json, tokenizer, checkpoints).')
  flags.DEFINE_string('sentences', None, "Source sentences, separated by '|'.")
  flags.DEFINE_string('input', None, 'Or a file of source sentences, one per line.')
  flags.DEFINE_string('targets', None, "Translations to read instead of translating, '|'-"
                      'separated (one per sentence).')
  flags.DEFINE_string('output_dir', None, 'Where the PNG and .npz files go.')
  flags.DEFINE_string('checkpoint', None, "A step, 'averaged', 'best', 'ema'; unset: the "
                      'newest moving average if the newest checkpoint holds one, else the '
                      'newest checkpoint.')
  flags.DEFINE_integer('beam_size', None, 'Beam size (default: the run\'s).', lower_bound=1)
  flags.mark_flags_as_required(['workdir', 'output_dir'])


def main(argv):
  if len(argv) > 1:
    sys.exit(f'error: unexpected arguments {argv[1:]} (flags take the form --name=value).')
  if (FLAGS.sentences is None) == (FLAGS.input is None):
    sys.exit('error: give exactly one of --sentences and --input.')
  console.quiet_libraries()
  startup.use_compilation_cache(FLAGS.workdir)
  sentences = (FLAGS.sentences.split('|') if FLAGS.sentences is not None
               else text_io.read_lines(FLAGS.input))
  targets = FLAGS.targets.split('|') if FLAGS.targets is not None else None
  try:
    written = plot(FLAGS.workdir, sentences, FLAGS.output_dir, targets, FLAGS.checkpoint,
                   FLAGS.beam_size)
  except (ValueError, FileNotFoundError, checkpoints.DamagedCheckpointError) as error:
    sys.exit(f'error: {error}')
  print(f'Wrote {len(written)} files to {FLAGS.output_dir}.')


if __name__ == '__main__':
  define_flags()
  app.run(main)
