r"""Translates with a folder written by `export.py --format jax`, using only jax, numpy,
sentencepiece and flatbuffers (which jax.export needs to read the programs; no Flax, TensorFlow
or code of the training project): copy the folder anywhere.

  pip install jax numpy sentencepiece flatbuffers

  python serving.py --model EXPORTED_DIR < input.txt > output.txt
  python serving.py --model EXPORTED_DIR          # interactive: one line in, one line out
  some_command | python serving.py --model EXPORTED_DIR   # the lines that have arrived together
  python serving.py --model EXPORTED_DIR --http 8080   # a page at /, POST /translate, /health

  from serving import ExportedTranslator
  translator = ExportedTranslator('EXPORTED_DIR')
  translator.translate(['A dog runs in the snow.'])
  translator.translate_details(['A dog runs.'], nbest=4, attention=True)

Every input line gives exactly one output line (an empty line gives an empty line): as in
decode.py, lines end at '\n' only (a '\r' before it is dropped, and a UTF-8 BOM at the start of
the input), and input that is not UTF-8 is an error naming its line. Sources longer than the
largest bucket are cut to it with a warning on stderr.

Over HTTP (standard library only), a JSON body {"text": ["sentence", ...]} (or one string) gets
{"translations": [...]} in the same order; {"text": [...], "nbest": 4, "attention": true} also
gets "details": per sentence its n-best translations with scores, pieces, per-piece
log-probabilities, alignments and cross-attention. Requests that arrive while a batch
translates are translated together in the next batch, one search at a time; limits on
sentences, characters, body size and connections give JSON errors; GET /health answers how the
server is; GET / is a page to translate on and see the attention. SIGTERM (or Ctrl-C) stops
accepting connections, answers every request begun, then exits. One access-log line per
request goes to stderr.

This file is the command; the translator, the batcher and the HTTP server are the modules
serving_translator.py, serving_batcher.py and serving_http.py (and the page serving_page.html):
beside it in an exported folder, in nmt/ in a checkout.
"""

from __future__ import annotations

import argparse
import os
import signal
import stat
import sys
import threading
from collections.abc import Sequence

import jax

_FOLDER = os.path.dirname(os.path.abspath(__file__))
if os.path.isfile(os.path.join(_FOLDER, 'serving_http.py')):  # An exported folder: its copies.
  if _FOLDER not in sys.path:
    sys.path.insert(0, _FOLDER)
  import serving_batcher
  import serving_http
  import serving_translator
  import text_io
else:  # A checkout: the library's modules.
  from nmt import serving_batcher, serving_http, serving_translator, text_io

# The library's API, importable from here (`from serving import ExportedTranslator`).
ExportedTranslator = serving_translator.ExportedTranslator
output_line = serving_translator.output_line
Batcher = serving_batcher.Batcher
make_http_server = serving_http.make_http_server


def serve(translator: ExportedTranslator, args: argparse.Namespace) -> None:
  """Serves HTTP until SIGTERM or SIGINT, then drains: no new connections, every request
  begun is answered, then the process ends."""
  try:
    server = make_http_server(
        translator, args.host, args.http, max_sentences=args.max_sentences,
        max_characters=args.max_characters, max_body_bytes=args.max_body_bytes,
        max_connections=args.max_connections, batch_sentences=args.batch_sentences,
        batch_tokens=args.batch_tokens, max_queued_sentences=args.max_queued_sentences,
        pool=not args.no_pool, pool_steps=args.pool_steps, warm_up=args.warmup)
  except OSError as error:  # The port is taken, or the address is not this machine's.
    sys.exit(f'error: cannot serve on {args.host}:{args.http}: {error.strerror or error}.')
  stopping = []

  def stop(signum, frame):
    if not stopping:  # serve_forever returns once shutdown (another thread) has been asked.
      stopping.append(signal.Signals(signum).name)
      threading.Thread(target=server.shutdown, daemon=True).start()

  signal.signal(signal.SIGTERM, stop)
  signal.signal(signal.SIGINT, stop)
  url = f'http://{args.host}:{server.server_port}'
  print(f'Serving {url}/ (page), {url}/translate (POST), {url}/health', file=sys.stderr,
        flush=True)
  server.serve_forever()
  server.stop_accepting()
  connections = server.connections
  print(f'{stopping[0]}: draining ({connections["busy"]} requests in flight); new connections '
        'are refused', file=sys.stderr, flush=True)
  server.drain()
  print('Stopped: every request begun was answered', file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', required=True, help='a folder written by export.py')
  parser.add_argument('--input', default='-', help='source text, one sentence per line')
  parser.add_argument('--output', default='-', help='where the translations go')
  parser.add_argument('--http', type=int, metavar='PORT',
                      help='serve POST /translate on this port instead (0: a free one)')
  parser.add_argument('--host', default='127.0.0.1', help='--http: the address to listen on')
  for name, default, what in (
      ('max_sentences', serving_http.MAX_SENTENCES, 'sentences per request'),
      ('max_characters', serving_http.MAX_CHARACTERS, 'characters per sentence'),
      ('max_body_bytes', serving_http.MAX_BODY_BYTES, 'bytes of a request body'),
      ('max_connections', serving_http.MAX_CONNECTIONS, 'open connections'),
      ('max_queued_sentences', serving_http.MAX_QUEUED_SENTENCES,
       'sentences waiting to be translated'),
      ('batch_sentences', serving_http.BATCH_SENTENCES, 'sentences translated together')):
    parser.add_argument(f'--{name}', type=int, default=default,
                        help=f'--http: the most {what} (default {default})')
  parser.add_argument('--batch_tokens', type=int,
                      help='--http: the most source tokens translated together (default: the '
                           "model's batch_tokens)")
  parser.add_argument('--no_pool', action='store_true',
                      help='--http: translate in batches only, not in the slot pool')
  parser.add_argument('--pool_steps', type=int, default=2,
                      help='--http: search steps per call of the slot pool (default 2)')
  parser.add_argument('--warmup', action='store_true',
                      help='--http: compile the slot pool before serving (no request waits '
                           'for a compile; kept in the compilation cache)')
  args = parser.parse_args(argv)
  # Argument errors before loading the model, each one line.
  if not os.path.isfile(os.path.join(args.model, 'translator.json')):
    sys.exit(f'error: {args.model} is not a folder written by export.py --format jax.')
  if args.http is not None and not 0 <= args.http <= 65535:
    sys.exit(f'error: --http {args.http}: a port is a number from 0 to 65535.')
  for name in ('max_sentences', 'max_characters', 'max_body_bytes', 'max_connections',
               'max_queued_sentences', 'batch_sentences', 'batch_tokens', 'pool_steps'):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      sys.exit(f'error: --{name} {getattr(args, name)}: must be at least 1.')
  if args.http is None and args.input != '-' and not os.path.isfile(args.input):
    sys.exit(f'error: --input {args.input}: '
             + ('a folder, not a file.' if os.path.isdir(args.input) else 'no such file.'))
  if args.http is None and args.output != '-':
    folder = os.path.dirname(os.path.abspath(args.output))
    if os.path.isdir(args.output):
      sys.exit(f'error: --output {args.output}: a folder, not a file.')
    if not os.path.isdir(folder):
      sys.exit(f'error: --output {args.output}: the folder {folder} does not exist.')
  streaming = args.http is None and args.input == '-' and not stat.S_ISREG(
      os.fstat(sys.stdin.fileno()).st_mode)  # A pipe or a terminal: each line as it arrives.
  lines = None
  if args.http is None and not streaming:
    try:  # Before loading the model: bad input fails at once.
      lines = text_io.read_lines(args.input)
    except (OSError, ValueError) as error:
      sys.exit(f'error: {error}')
  if not jax.config.jax_compilation_cache_dir:  # Later runs load the compiled programs.
    jax.config.update('jax_compilation_cache_dir', os.path.join(args.model, 'compilation_cache'))
  try:
    translator = ExportedTranslator(args.model)
  except (ImportError, OSError, ValueError) as error:
    sys.exit(f'error: {error}')
  if args.http is not None:
    serve(translator, args)
    return
  try:
    out = sys.stdout if args.output == '-' else open(args.output, 'w', encoding='utf-8')
  except OSError as error:
    sys.exit(f'error: {error}')
  if streaming:
    line_number = 1
    try:
      for chunk in text_io.stream_lines(sys.stdin.fileno()):
        out.writelines(output_line(t) + '\n' for t in translator.translate(chunk, line_number))
        out.flush()
        line_number += len(chunk)
    except ValueError as error:  # Invalid UTF-8: the lines before it are translated.
      sys.exit(f'error: {error}')
  else:
    out.writelines(output_line(t) + '\n' for t in translator.translate(lines))
  if out is not sys.stdout:
    out.close()


if __name__ == '__main__':
  main()
