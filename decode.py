"""Translates text with a trained run: beam search, length-sorted batches, sacreBLEU/chrF.

  python decode.py --workdir runs/multi30k --input src.txt --output hyp.txt \
      [--reference ref.txt] [--beam_size 4] [--alpha 0.6] [--nbest N] [--batch_tokens N] \
      [--checkpoint STEP | --checkpoint averaged | --average_last N]
  python decode.py --workdir runs/multi30k --split test_2016_flickr   # a dataset split

`-` reads stdin / writes stdout. Every input line gives exactly one output line (an empty
line gives an empty line); with --nbest N > 1 each line holds N tab-separated translations.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np
import sacrebleu
from absl import app, flags, logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import checkpoints
import input_pipeline
import train
from model import Transformer
from model.decoding import beam_search

FLAGS = flags.FLAGS


def load_run(workdir: str) -> tuple[ml_collections.ConfigDict, input_pipeline.Tokenizer,
                                    Transformer]:
  """The run's config, tokenizer and model (everything decoding needs but the parameters)."""
  config_path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f'{config_path} not found: --workdir must be a training workdir.')
  with open(config_path, encoding='utf-8') as f:
    config = ml_collections.ConfigDict(json.load(f))
  tokenizer = input_pipeline.load_tokenizer(os.path.join(workdir, 'tokenizer.model'))
  return config, tokenizer, Transformer(train.model_config(config, tokenizer.vocab_size))


def translate(model: Transformer, params: Any, tokenizer: input_pipeline.Tokenizer,
              sources: list[str], config: ml_collections.ConfigDict, *,
              mesh: Mesh | None = None, beam_size: int | None = None, alpha: float | None = None,
              nbest: int = 1, batch_tokens: int | None = None,
              progress: bool = False) -> list[str] | list[list[str]]:
  """Beam-search translations of `sources`, in their order (nbest > 1: a list per source).

  Sentences are batched by length (fewer pad tokens), batches split over the devices of
  `mesh` (default: all devices). Empty sources give empty translations; sources longer than
  the model's maximum are truncated with a warning.
  """
  beam_size = beam_size or config.beam_size
  alpha = config.length_penalty_alpha if alpha is None else alpha
  mesh = mesh or Mesh(np.asarray(jax.devices()), ('data',))
  row_sharding = NamedSharding(mesh, P(mesh.axis_names))
  num_devices = mesh.devices.size
  token_ids = tokenizer.encode(sources)
  outputs: list[Any] = [[''] * nbest for _ in sources]
  nonempty = [i for i, text in enumerate(sources) if text.strip()]
  max_source = model.config.max_len
  batches = input_pipeline.make_eval_batches(
      [token_ids[i] for i in nonempty], batch_tokens or config.eval_batch_tokens, max_source)

  @functools.partial(jax.jit, static_argnames=('max_decode_len',))
  def search(params, inputs, max_decode_len):
    return beam_search(model, params, inputs, beam_size=beam_size, alpha=alpha,
                       max_decode_len=max_decode_len,
                       max_extra_length=config.max_decode_extra_length, nbest=nbest)

  start, done = time.time(), 0
  for batch_index, (indices, ids) in enumerate(batches):
    rows = len(indices)
    # Rows padded to a power of two (fewer shapes to compile) that divides over the devices.
    padded_rows = max(num_devices, 1 << (rows - 1).bit_length())
    padded_rows = -(-padded_rows // num_devices) * num_devices
    ids = np.pad(ids, ((0, padded_rows - rows), (0, 0)))
    inputs = jax.make_array_from_callback(ids.shape, row_sharding,
                                          lambda index, ids=ids: ids[index])
    max_decode_len = min(ids.shape[1] + config.max_decode_extra_length,
                         config.max_decode_length, model.config.max_len)
    sequences, _ = jax.device_get(search(params, inputs, max_decode_len))
    for row, index in enumerate(indices):
      outputs[nonempty[index]] = [tokenizer.decode(s) for s in sequences[row]]
    done += rows
    if progress and (batch_index % 10 == 9 or batch_index == len(batches) - 1):
      rate = done / (time.time() - start)
      logging.info('translated %d/%d sentences | %.1f sentences/s | ETA %s', done,
                   len(nonempty), rate, train.format_duration((len(nonempty) - done) / rate))
  return [o[0] for o in outputs] if nbest == 1 else outputs


def score(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
  """sacreBLEU (cased and lowercased, 13a) and chrF of detokenized text, with signatures."""
  if len(hypotheses) != len(references):
    raise ValueError(f'{len(hypotheses)} translations but {len(references)} references.')
  bleu, bleu_lower, chrf = (sacrebleu.metrics.BLEU(), sacrebleu.metrics.BLEU(lowercase=True),
                            sacrebleu.metrics.CHRF())
  return {
      'bleu': bleu.corpus_score(hypotheses, [references]).score,
      'bleu_lowercase': bleu_lower.corpus_score(hypotheses, [references]).score,
      'chrf': chrf.corpus_score(hypotheses, [references]).score,
      'bleu_signature': str(bleu.get_signature()),
      'chrf_signature': str(chrf.get_signature()),
  }


def _read_input(path: str) -> list[str]:
  if path != '-':
    return input_pipeline.read_lines(path)
  data = sys.stdin.buffer.read()
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as error:
    line = data.count(b'\n', 0, error.start) + 1
    raise ValueError(f'stdin:{line}: invalid UTF-8; convert the input to UTF-8.') from None
  lines = text.split('\n')
  if lines and lines[-1] == '':
    lines.pop()
  return [line.rstrip('\r') for line in lines]


def define_flags():
  """Command-line flags (defined only when run as a script, so other code can import us)."""
  flags.DEFINE_string('workdir', None, 'Training workdir (config, tokenizer, checkpoints).')
  flags.DEFINE_string('input', None, 'Source text file, one sentence per line; - = stdin.')
  flags.DEFINE_string('split', None, "A split of the run's dataset instead of --input (its "
                      'references are scored).')
  flags.DEFINE_string('output', '-', 'Where translations go; - = stdout.')
  flags.DEFINE_string('reference', None, 'Reference translations to score against.')
  flags.DEFINE_integer('beam_size', None, 'Beam size (default: the run config).')
  flags.DEFINE_float('alpha', None, 'Length penalty exponent (default: the run config).')
  flags.DEFINE_integer('nbest', 1, 'Translations per sentence.')
  flags.DEFINE_integer('batch_tokens', None, 'Source tokens per batch.')
  flags.DEFINE_string('checkpoint', None, "A step, 'averaged', or the newest if unset.")
  flags.DEFINE_integer('average_last', 0, 'Average the newest N checkpoints.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.workdir:
    raise app.UsageError('--workdir is required.')
  if (FLAGS.input is None) == (FLAGS.split is None):
    raise app.UsageError('Give exactly one of --input FILE and --split NAME.')
  try:
    config, tokenizer, model = load_run(FLAGS.workdir)
    if FLAGS.split:
      sources, references = input_pipeline.read_split(config, FLAGS.split)
    else:
      sources = _read_input(FLAGS.input)
      references = input_pipeline.read_lines(FLAGS.reference) if FLAGS.reference else None
    if references is not None and len(references) != len(sources):
      raise ValueError(f'{len(sources)} source lines but {len(references)} reference lines.')
    params, origin = checkpoints.load_params(FLAGS.workdir, FLAGS.checkpoint,
                                             FLAGS.average_last)
  except (FileNotFoundError, ValueError) as error:
    sys.exit(f'error: {error}')
  logging.info('Translating %d sentences with %s (beam %s).', len(sources), origin,
               FLAGS.beam_size or config.beam_size)
  start = time.time()
  translations = translate(model, params, tokenizer, sources, config,
                           beam_size=FLAGS.beam_size, alpha=FLAGS.alpha, nbest=FLAGS.nbest,
                           batch_tokens=FLAGS.batch_tokens, progress=True)
  elapsed = time.time() - start
  logging.info('Translated %d sentences in %.1f s (%.1f sentences/s).', len(sources), elapsed,
               len(sources) / max(elapsed, 1e-9))
  lines = translations if FLAGS.nbest == 1 else ['\t'.join(t) for t in translations]
  text = ''.join(line + '\n' for line in lines)
  if FLAGS.output == '-':
    sys.stdout.write(text)
    sys.stdout.flush()
  else:
    with open(FLAGS.output, 'w', encoding='utf-8') as f:
      f.write(text)
  if references is not None:
    best = translations if FLAGS.nbest == 1 else [t[0] for t in translations]
    scores = score(best, references)
    print(f"BLEU {scores['bleu']:.2f} ({scores['bleu_signature']})\n"
          f"BLEU (lowercase) {scores['bleu_lowercase']:.2f}\n"
          f"chrF {scores['chrf']:.2f} ({scores['chrf_signature']})", file=sys.stderr)


if __name__ == '__main__':
  define_flags()
  app.run(main)
