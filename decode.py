"""Translates text with a trained run: beam search, length-sorted batches, sacreBLEU/chrF.

  python decode.py --workdir runs/multi30k --input src.txt --output hyp.txt \
      [--reference ref.txt] [--beam_size 4] [--alpha 1.3] [--nbest N] [--batch_tokens N] \
      [--stopping exact|early] [--min_length N] [--output_format text|json] \
      [--target_prefix prefixes.txt] \
      [--checkpoint STEP | --checkpoint averaged|best|ema | --average_last N] \
      [--ensemble RUN2[:STEP|:averaged|:best|:ema],RUN3 [--ensemble_weights 1,1,1]]
  python decode.py --workdir runs/multi30k --split test_2016_flickr   # a dataset split

`-` reads stdin / writes stdout; from a pipe or a terminal each line is translated as soon as
it arrives and its translation flushed (`python decode.py --workdir RUN --input -` is an
interactive translator). Every input line gives exactly one output line (an empty line gives
an empty line: N - 1 tabs with --nbest N); with --nbest N > 1 each line holds N tab-separated
translations;
--output_format json writes one JSON object per line instead (scores, pieces, per-piece
log-probabilities of each of the nbest translations).
Runs on whatever devices this machine has, whatever the run was trained on; with
--distributed, on every device of several processes (as train.py), process 0 writing the
output and the scores.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from typing import Any

import jax
from absl import app, flags, logging

import input_pipeline
from nmt import checkpoints, runs, scoring, sharding, startup, text_io
from nmt.translator import Translator

FLAGS = flags.FLAGS


def decode(workdir: str, *, input_path: str | None = None, split: str | None = None,
           output: str = '-', reference: str | None = None, beam_size: int | None = None,
           alpha: float | None = None, nbest: int = 1, batch_tokens: int | None = None,
           stopping: str | None = None, checkpoint: str | None = None,
           average_last: int = 0, output_format: str = 'text',
           target_prefix: str | None = None, ensemble: str | None = None,
           ensemble_weights: str | None = None, min_length: int | None = None,
           score_reference: bool = False, attention: bool = False) -> dict[str, Any] | None:
  """Translates --input or --split, writes the translations, returns the scores (if any);
  with `score_reference`, writes the model's scores of the references instead.

  Input from a pipe or a terminal is translated as it arrives, each output line flushed;
  otherwise the output file is opened once every translation is done, so a failed call leaves
  an existing file as it was.
  """
  config, tokenizer, model = runs.load_run(workdir)
  streaming = split is None and input_path == '-' and not stat.S_ISREG(
      os.fstat(sys.stdin.fileno()).st_mode)
  if split:
    sources, references = input_pipeline.read_split(config, split,
                                                     process_index=jax.process_index())
  else:
    sources = None if streaming else text_io.read_lines(input_path)
    references = text_io.read_lines(reference) if reference else None
  if sources is not None and references is not None and len(references) != len(sources):
    raise ValueError(f'{len(sources)} source lines but {len(references)} reference lines.')
  if target_prefix and streaming:
    raise ValueError('--target_prefix pairs its lines with a whole input: give --input FILE, '
                     'or redirect stdin from a file (`< FILE`), not a pipe or a terminal.')
  if score_reference and (streaming or references is None):
    raise ValueError('--score_reference scores given translations: give --input FILE with '
                     '--reference FILE, or --split.')
  if attention and output_format != 'json':
    raise ValueError('--attention adds the cross-attention to JSON output: add '
                     '--output_format json.')
  prefixes = text_io.read_lines(target_prefix) if target_prefix else None
  if prefixes is not None and len(prefixes) != len(sources):
    raise ValueError(f'--target_prefix {target_prefix} needs one line per source line ('
                     f'{len(prefixes)} lines, {len(sources)} sources).')
  mesh = sharding.make_mesh()
  params, origin = runs.load_params(workdir, mesh, checkpoint, average_last)
  weights = None
  if ensemble:
    model, params, origin, weights = runs.load_ensemble(ensemble, ensemble_weights, tokenizer, mesh,
                                                   model, params, origin)
  translator = Translator(model, tokenizer, config.decode, mesh, beam_size=beam_size, alpha=alpha,
                          nbest=nbest, batch_tokens=batch_tokens, stopping=stopping,
                          details=output_format == 'json', weights=weights,
                          min_length=min_length, attention=attention)
  pieces = tokenizer.encode_pieces
  lines = lambda sources, translations: ''.join(
      format_output(source, translation, nbest, output_format, pieces) + '\n'
      for source, translation in zip(sources, translations))
  writes = jax.process_index() == 0  # Every process holds every translation; one writes.
  out = None
  open_output = lambda: sys.stdout if output == '-' else open(output, 'w', encoding='utf-8')
  if score_reference:
    scored = translator.score(params, sources, references)
    if writes:
      out = open_output()
      try:
        out.writelines(format_score(source, result, output_format, pieces) + '\n'
                       for source, result in zip(sources, scored, strict=True))
        out.flush()
      finally:
        if out is not sys.stdout:
          out.close()
    return None
  translations = []
  try:
    if streaming:
      if jax.process_count() > 1:
        raise ValueError('--distributed translates files or splits, not a stream on stdin.')
      out = open_output()
      logging.info('Translating stdin line by line with %s (beam %d).', origin,
                   translator.beam_size)
      for chunk in text_io.stream_lines(sys.stdin.fileno()):
        chunk_translations = translator(params, chunk)
        out.write(lines(chunk, chunk_translations))
        out.flush()
        translations.extend(chunk_translations)
    else:
      logging.info('Translating %d sentence(s) with %s (beam %d) on %d device(s).',
                   len(sources), origin, translator.beam_size, mesh.devices.size)
      start = time.time()
      translations = translator(params, sources, progress=True, prefixes=prefixes)
      elapsed = time.time() - start
      logging.info('Translated %d sentences in %.1f s (%.1f sentences/s).', len(sources),
                   elapsed, len(sources) / max(elapsed, 1e-9))
      if writes:
        out = open_output()
        out.write(lines(sources, translations))
        out.flush()
  finally:
    if out is not None and out is not sys.stdout:
      out.close()
  if references is None:
    return None
  if len(references) != len(translations):
    raise ValueError(f'{len(translations)} source lines but {len(references)} reference lines.')
  if not references:
    logging.warning('No sentences: nothing to score.')
    return None
  if output_format == 'json':
    best = [t[0]['text'] if t else '' for t in translations]
  else:
    best = translations if nbest == 1 else [t[0] for t in translations]
  scores = scoring.score(best, references, config.data.target_lang)
  if writes:
    print(f"BLEU {scores['bleu']:.2f} ({scores['bleu_signature']})\n"
          f"BLEU (lowercase) {scores['bleu_lowercase']:.2f}\n"
          f"chrF {scores['chrf']:.2f} ({scores['chrf_signature']})\n"
          f"{scoring.TOK_LC_NAME} {scores['bleu_tok_lc']:.2f}", file=sys.stderr)
  return scores


def format_output(source: str, translation: Any, nbest: int, output_format: str,
                  pieces: Any) -> str:
  """One input line's output line: its translation (nbest > 1: tab-separated translations), or
  with output_format 'json' an object {"source", "source_tokens", "translations": [{"text",
  "score", "log_prob", "tokens", "token_log_probs", "align"[, "attention"]}, ...]} (no
  translations for an empty line); `align` indexes `source_tokens` (pieces, then '</s>')."""
  if output_format == 'json':
    return json.dumps({'source': source, 'source_tokens': pieces(source) + ['</s>'],
                       'translations': translation}, ensure_ascii=False)
  return output_line(translation if nbest > 1 else [translation])


def format_score(source: str, scored: dict[str, Any], output_format: str, pieces: Any) -> str:
  """One input line's output with --score_reference: the reference's log-probability, or
  with output_format 'json' an object {"source", "source_tokens", "reference", "log_prob",
  "tokens", "token_log_probs", "align"[, "attention"]}."""
  if output_format == 'json':
    return json.dumps({'source': source, 'source_tokens': pieces(source) + ['</s>'],
                       'reference': scored.pop('text'), **scored}, ensure_ascii=False)
  return f"{scored['log_prob']:.6f}"


def output_line(translations: list[str]) -> str:
  """One sentence's translations as one output line, tab-separated.

  A translation may decode to any character (byte fallback pieces included): line breaks and
  tabs inside one become spaces, so every input line keeps exactly one output line.
  """
  return '\t'.join(' '.join(t.replace('\t', ' ').splitlines()) for t in translations)


def define_flags():
  """Command-line flags (defined only when run as a script, so other code can import us)."""
  flags.DEFINE_string('workdir', None, 'Training workdir (config, tokenizer, checkpoints).')
  flags.DEFINE_string('input', None, 'Source text file, one sentence per line; - = stdin.')
  flags.DEFINE_string('split', None, "A split of the run's dataset instead of --input (its "
                      'references are scored).')
  flags.DEFINE_string('output', '-', 'Where translations go; - = stdout.')
  flags.DEFINE_string('reference', None, 'Reference translations to score against.')
  flags.DEFINE_integer('beam_size', None, 'Beam size (default: the run config).', lower_bound=1)
  flags.DEFINE_float('alpha', None, 'Length penalty exponent (default: the run config).')
  flags.DEFINE_integer('nbest', 1, 'Translations per sentence (<= beam size).', lower_bound=1)
  flags.DEFINE_integer('batch_tokens', None, 'Source tokens per batch.', lower_bound=1)
  flags.DEFINE_string('ensemble', None, "Runs decoded together with --workdir's model as one "
                      "ensemble: RUN (as without --checkpoint), RUN:STEP, RUN:averaged, RUN:best "
                      "or RUN:ema, comma-separated (the next token's log-probabilities are the "
                      "members' weighted mean).")
  flags.DEFINE_string('ensemble_weights', None, 'Comma-separated weights, --workdir first '
                      '(default: equal).')
  flags.DEFINE_string('target_prefix', None, 'A file of target prefixes, one per input line (an '
                      'empty line: none): each translation starts with its prefix.')
  flags.DEFINE_enum('output_format', 'text', ['text', 'json'],
                    "'json': one object per line with each of the nbest translations' score, "
                    'log-probability, pieces and per-piece log-probabilities.')
  flags.DEFINE_integer('min_length', None, 'The fewest tokens before the end of a nonempty '
                       "source's translation (default: the run config's, or 1: never empty).",
                       lower_bound=0)
  flags.DEFINE_enum('stopping', None, ['exact', 'early'],
                    "When a sentence's search ends (default: the run config): 'exact' once no "
                    "live hypothesis can win, 'early' once none would by ending next step.")
  flags.DEFINE_string('checkpoint', None, "A step, 'averaged', 'best' (by the validation "
                      "metric), 'ema' (the newest moving average); unset: the newest moving "
                      "average if the newest checkpoint holds one (optimizer.ema_decay), else "
                      'the newest checkpoint.')
  flags.DEFINE_integer('average_last', 0, 'Average the newest N checkpoints.', lower_bound=0)
  flags.DEFINE_bool('score_reference', False, "Score the references (--reference, or the "
                    "split's) instead of translating: each line's log-probability, or with "
                    '--output_format json its per-token log-probabilities and alignment.')
  flags.DEFINE_bool('attention', False, 'With --output_format json: also each translation\'s '
                    'cross-attention [target token][source token], averaged over layers and '
                    'heads.')
  startup.define_distributed_flags()


def main(argv):
  # One line for each mistake (app.UsageError would print the whole flag help with it).
  if len(argv) > 1:
    sys.exit(f'error: unexpected arguments {argv[1:]} (flags take the form --name=value).')
  if not FLAGS.workdir:
    sys.exit('error: --workdir is required.')
  if (FLAGS.input is None) == (FLAGS.split is None):
    sys.exit('error: give exactly one of --input FILE and --split NAME.')
  if FLAGS.split and FLAGS.reference:
    sys.exit('error: --split scores against its own references; --reference goes with --input.')
  if FLAGS.output != '-' and not os.path.isdir(os.path.dirname(os.path.abspath(FLAGS.output))):
    sys.exit(f'error: --output {FLAGS.output}: its folder does not exist.')
  if FLAGS.output != '-' and os.path.isdir(FLAGS.output):
    sys.exit(f'error: --output {FLAGS.output} is a folder; name a file in it.')
  startup.start(FLAGS.workdir)
  try:
    decode(FLAGS.workdir, input_path=FLAGS.input, split=FLAGS.split, output=FLAGS.output,
           reference=FLAGS.reference, beam_size=FLAGS.beam_size, alpha=FLAGS.alpha,
           nbest=FLAGS.nbest, batch_tokens=FLAGS.batch_tokens, stopping=FLAGS.stopping,
           output_format=FLAGS.output_format, target_prefix=FLAGS.target_prefix,
           ensemble=FLAGS.ensemble, ensemble_weights=FLAGS.ensemble_weights,
           checkpoint=FLAGS.checkpoint, average_last=FLAGS.average_last,
           min_length=FLAGS.min_length, score_reference=FLAGS.score_reference,
           attention=FLAGS.attention)
  except (FileNotFoundError, ValueError, checkpoints.DamagedCheckpointError) as error:
    sys.exit(f'error: {error}')
  except OSError as error:  # Writing the output: a full disk, a closed pipe, no permission.
    sys.exit(f'error: {error.filename or FLAGS.output}: {error.strerror or error}')


def exit_without_teardown() -> None:
  """Ends a finished single-process command at once: its output is written and flushed, so
  the interpreter's teardown (freeing every JAX buffer and the client) is time spent for
  nothing. Several processes shut jax.distributed down as usual."""
  if jax.process_count() == 1:
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main_then_exit(argv):
  main(argv)
  exit_without_teardown()


if __name__ == '__main__':
  define_flags()
  app.run(main_then_exit)
