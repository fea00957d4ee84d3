r"""Translates with a folder written by `export.py --format jax`, using only jax, numpy,
sentencepiece and flatbuffers (which jax.export needs to read the programs; no Flax, TensorFlow
or code of the training project): copy the folder anywhere.

  pip install jax numpy sentencepiece flatbuffers

  python serving.py --model EXPORTED_DIR < input.txt > output.txt
  python serving.py --model EXPORTED_DIR          # interactive: one line in, one line out
  some_command | python serving.py --model EXPORTED_DIR   # the lines that have arrived together
  python serving.py --model EXPORTED_DIR --http 8080   # POST /translate {"text": [...]}

  from serving import ExportedTranslator
  translator = ExportedTranslator('EXPORTED_DIR')
  translator.translate(['A dog runs in the snow.'])

Every input line gives exactly one output line (an empty line gives an empty line): as in
decode.py, lines end at '\n' only (a '\r' before it is dropped, and a UTF-8 BOM at the start of
the input), and input that is not UTF-8 is an error naming its line. Sources longer than the
largest bucket are cut to it with a warning on stderr. Over HTTP, a JSON body
{"text": ["sentence", ...]} (or one string) gets {"translations": [...]} in the same order; the
server (standard library only) reads each connection in a thread and translates one request at a
time; bodies over MAX_BODY_BYTES (10 MB) get 413, errors a JSON {"error": ...}.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import select
import stat
import sys
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer

import jax
import jax.numpy as jnp
import numpy as np
import sentencepiece as spm

MAX_BODY_BYTES = 10 * 1024 * 1024  # The largest POST body the server reads (413 beyond it).
READ_TIMEOUT_SECONDS = 60.0  # How long the server waits for a client's next bytes.


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
  """{'a/b': x} -> {'a': {'b': x}}."""
  tree: dict = {}
  for name, value in flat.items():
    node = tree
    *parents, leaf = name.split('/')
    for parent in parents:
      node = node.setdefault(parent, {})
    node[leaf] = value
  return tree


# Input lines follow input_pipeline.read_lines/stream_lines (decode.py's), repeated here because
# this file runs without the project's code; tests/test_input_pipeline.py holds them equal.


def _text_lines(lines: list[bytes], name: str, first_line: int) -> list[str]:
  r"""UTF-8 `lines` (the first is line `first_line` of `name`) without a trailing '\r' (of
  '\r\n'), as decode.py reads them; a UTF-8 BOM at the start of the input is dropped. Invalid
  UTF-8 raises a ValueError naming the file and the line."""
  if first_line == 1 and lines and lines[0].startswith(codecs.BOM_UTF8):
    lines = [lines[0][len(codecs.BOM_UTF8):], *lines[1:]]
  texts = []
  for number, line in enumerate(lines, first_line):
    try:
      texts.append(line.decode('utf-8').rstrip('\r'))
    except UnicodeDecodeError as e:
      raise ValueError(f'{name}:{number}: invalid UTF-8 ({e.reason}); convert the file to UTF-8, '
                       'e.g. `iconv -f LATIN1 -t UTF-8`.') from None
  return texts


def read_lines(path: str) -> list[str]:
  r"""Lines of a UTF-8 file ('-': stdin), split at '\n' only: a lone '\r' inside a line stays
  in it (text-mode reading would split there and shift every later line)."""
  if path == '-':
    name, data = 'stdin', sys.stdin.buffer.read()
  else:
    with open(path, 'rb') as f:
      name, data = path, f.read()
  lines = data.split(b'\n')
  if lines[-1] == b'':
    lines.pop()  # The newline that ends the last line.
  return _text_lines(lines, name, 1)


def stream_lines(fd: int, max_lines: int = 1024, name: str = 'stdin') -> Iterator[list[str]]:
  """Lines of a pipe or terminal as they arrive, in chunks translated together.

  Each chunk holds at least one line: it waits for the first, then takes the complete lines
  already readable without waiting (at most `max_lines`), so a line typed alone is answered at
  once and a pipe full of lines is translated in batches. A last line without a newline counts.
  Lines and errors as `read_lines`.
  """
  pending, line_number, ended = b'', 1, False
  while not ended:
    lines: list[bytes] = []
    while len(lines) < max_lines:
      if lines and not select.select([fd], [], [], 0)[0]:
        break  # Nothing more right now: translate what has arrived.
      data = os.read(fd, 1 << 16)
      if not data:
        ended = True
        if pending:
          lines.append(pending)
        break
      *complete, pending = (pending + data).split(b'\n')
      lines.extend(complete)
    if lines:
      yield _text_lines(lines, name, line_number)
      line_number += len(lines)


class ExportedTranslator:
  """Beam-search translation with the exported programs, batched by source-length bucket.

  Each (bucket, batch rows) shape compiles once, on first use; batch rows are powers of two.
  A call with more sentences than the continuous batching slots of a CPU export decodes them
  with continuous batching (one program per bucket), the same translations.
  The command line keeps compiled programs in the folder's compilation_cache/.
  """

  def __init__(self, folder: str):
    try:  # jax.export.deserialize needs it: fail here, not at the first translation.
      import flatbuffers  # noqa: F401
    except ImportError:
      raise ImportError('serving.py needs the flatbuffers package to read the exported '
                        'programs: pip install flatbuffers') from None
    with open(os.path.join(folder, 'translator.json'), encoding='utf-8') as f:
      self.manifest = json.load(f)
    self.buckets = list(self.manifest['buckets'])
    self.eos_id, self.pad_id = self.manifest['eos_id'], self.manifest['pad_id']
    self.batch_tokens = self.manifest['batch_tokens']
    # Continuous batching programs (folders exported for the CPU): their slots and queue sizes.
    self.continuous = self.manifest.get('continuous') or {}
    # The programs run only on the platform they were exported for: refuse here, not at the
    # first translation.
    exported_for, platform = self.manifest['platform'], jax.export.default_export_platform()
    if exported_for != platform:
      raise ValueError(f'{folder} was exported for {exported_for} and jax here runs on '
                       f'{platform}: export it with `export.py --format jax --platform '
                       f'{platform}`, or translate on a {exported_for} machine.')
    files = ['tokenizer.model', 'params.npz'] + [f'translator_{b}.jax' for b in self.buckets]
    files += [f'continuous_{b}.jax' for b in self.continuous.get('sizes', {})]
    missing = [name for name in files if not os.path.isfile(os.path.join(folder, name))]
    if missing:
      raise FileNotFoundError(f'{folder} lacks {", ".join(missing)}: copy the whole folder '
                              'written by export.py --format jax.')
    self._sp = spm.SentencePieceProcessor(model_file=os.path.join(folder, 'tokenizer.model'))
    with np.load(os.path.join(folder, 'params.npz')) as arrays:
      self._params = jax.device_put(_unflatten({k: arrays[k] for k in arrays.files}))
    self._folder = folder
    self._programs: dict[str, jax.export.Exported] = {}

  def _program(self, name: str) -> jax.export.Exported:
    if name not in self._programs:
      with open(os.path.join(self._folder, f'{name}.jax'), 'rb') as f:
        self._programs[name] = jax.export.deserialize(bytearray(f.read()))
    return self._programs[name]

  def _text(self, sequence: np.ndarray) -> str:
    """A best hypothesis' text: its tokens up to EOS, detokenized."""
    tokens = sequence.tolist()
    end = tokens.index(self.eos_id) if self.eos_id in tokens else len(tokens)
    return self._sp.decode([t for t in tokens[:end] if t != self.pad_id])

  def _continuous(self, ids: list[list[int]], members: list[int], outputs: list[str]) -> None:
    """outputs[members] by continuous batching: longest first, per queue the smallest bucket
    that holds its longest sentence and as many sentences as its program takes."""
    members = sorted(members, key=lambda i: -len(ids[i]))
    start = 0
    while start < len(members):
      length = next(b for b in self.buckets if b >= len(ids[members[start]]))
      size = self.continuous['sizes'][str(length)]
      queue = members[start:start + size]
      sources = np.full((size, length), self.pad_id, np.int32)
      for row, i in enumerate(queue):
        sources[row, :len(ids[i])] = ids[i]
      sequences, _ = self._program(f'continuous_{length}').call(
          self._params, jnp.asarray(sources), jnp.int32(len(queue)))
      sequences = np.asarray(sequences)
      for row, i in enumerate(queue):
        outputs[i] = self._text(sequences[row, 0])
      start += size

  def translate(self, sources: Sequence[str], first_line: int = 1) -> list[str]:
    """Translations of `sources`, in their order; warnings call sources[0] line `first_line`."""
    ids = self._sp.encode([s for s in sources], out_type=int, add_eos=True)
    outputs = [''] * len(sources)
    by_bucket: dict[int, list[int]] = {}
    longest = self.buckets[-1]
    for i, (text, tokens) in enumerate(zip(sources, ids)):
      if not text.strip():
        continue
      if len(tokens) > longest:
        print(f'warning: line {first_line + i} has {len(tokens)} tokens; cut to {longest}.',
              file=sys.stderr)
        ids[i] = tokens[:longest - 1] + [self.eos_id]
      bucket = next(b for b in self.buckets if b >= len(ids[i]))
      by_bucket.setdefault(bucket, []).append(i)
    nonempty = sum(by_bucket.values(), [])
    if self.continuous and len(nonempty) > self.continuous['slots']:
      self._continuous(ids, nonempty, outputs)
      return outputs
    for length, members in sorted(by_bucket.items()):
      rows = max(1, 1 << (max(1, self.batch_tokens // length).bit_length() - 1))
      members.sort(key=lambda i: len(ids[i]))  # Sentences that end at about the same step.
      for start in range(0, len(members), rows):
        batch = members[start:start + rows]
        padded_rows = 1 << (len(batch) - 1).bit_length()
        inputs = np.full((padded_rows, length), self.pad_id, np.int32)
        for row, i in enumerate(batch):
          inputs[row, :len(ids[i])] = ids[i]
        sequences, _ = self._program(f'translator_{length}').call(self._params,
                                                                 jnp.asarray(inputs))
        sequences = np.asarray(sequences)  # One copy to the host, not one per row.
        for row, i in enumerate(batch):
          outputs[i] = self._text(sequences[row, 0])
    return outputs


def output_line(translation: str) -> str:
  """A translation on one line: line breaks and tabs inside it become spaces."""
  return ' '.join(translation.replace('\t', ' ').splitlines())


def make_http_server(translator: ExportedTranslator, host: str, port: int) -> HTTPServer:
  """An HTTP server (call serve_forever) answering POST /translate; port 0 picks a free one.

  Each connection has its own thread (a slow client holds up no other) and translations run
  one at a time. Errors are JSON {"error": ...}: 400 for a body that is not {"text": [...]}
  of Unicode strings, 404 for another path, 405 for another method, 408 for a body that does
  not arrive within READ_TIMEOUT_SECONDS, 413 for one over MAX_BODY_BYTES.
  """
  lock = threading.Lock()  # One translation at a time: the programs use every core.

  class Handler(BaseHTTPRequestHandler):
    timeout = READ_TIMEOUT_SECONDS  # Socket reads: a client that stops sending is let go.

    def do_POST(self):  # noqa: N802 (http.server's name)
      if self.path.rstrip('/') != '/translate':
        return self.reply(404, {'error': 'POST to /translate'})
      try:
        length = int(self.headers.get('Content-Length') or 0)
      except ValueError:
        length = -1
      if length > MAX_BODY_BYTES:
        self.close_connection = True  # Its body stays unread.
        return self.reply(413, {'error': f'the body has {length} bytes; at most '
                                         f'{MAX_BODY_BYTES} are read.'})
      try:
        body = self.rfile.read(max(length, 0))
      except TimeoutError:
        self.close_connection = True
        return self.reply(408, {'error': f'the body did not arrive within {self.timeout} s.'})
      if len(body) < length:  # The client left before sending its body: no one to answer.
        self.close_connection = True
        return
      try:
        if length < 0:
          raise ValueError
        text = json.loads(body)['text']
        text = [text] if isinstance(text, str) else text
        if not isinstance(text, list) or not all(isinstance(t, str) for t in text):
          raise TypeError
        for t in text:
          t.encode('utf-8')  # A lone surrogate ("\ud800") is no text to translate.
      except UnicodeEncodeError:
        return self.reply(400, {'error': 'the text holds a lone surrogate (such as \\ud800): '
                                         'send Unicode text'})
      except (ValueError, KeyError, TypeError):
        return self.reply(400, {'error': 'expected a JSON body {"text": ["sentence", ...]}'})
      with lock:
        translations = translator.translate(text)
      self.reply(200, {'translations': [output_line(t) for t in translations]})

    def do_GET(self):  # noqa: N802 (http.server's name)
      if self.path.rstrip('/') != '/translate':
        return self.reply(404, {'error': 'POST to /translate'})
      self.close_connection = True  # A body it may have stays unread.
      self.reply(405, {'error': f'{self.command} is not allowed: POST to /translate'},
                 Allow='POST')

    do_PUT = do_DELETE = do_PATCH = do_GET

    def reply(self, status: int, body: dict, **headers: str) -> None:
      data = json.dumps(body, ensure_ascii=False).encode('utf-8')
      self.send_response(status)
      self.send_header('Content-Type', 'application/json; charset=utf-8')
      self.send_header('Content-Length', str(len(data)))
      for name, value in headers.items():
        self.send_header(name, value)
      self.end_headers()
      self.wfile.write(data)

    def log_message(self, format, *args):  # noqa: A002 (http.server's signature)
      sys.stderr.write(f'{self.address_string()} {format % args}\n')

  return ThreadingHTTPServer((host, port), Handler)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', required=True, help='a folder written by export.py')
  parser.add_argument('--input', default='-', help='source text, one sentence per line')
  parser.add_argument('--output', default='-', help='where the translations go')
  parser.add_argument('--http', type=int, metavar='PORT',
                      help='serve POST /translate on this port instead (0: a free one)')
  parser.add_argument('--host', default='127.0.0.1', help='--http: the address to listen on')
  args = parser.parse_args(argv)
  # Argument errors before loading the model, each one line.
  if not os.path.isfile(os.path.join(args.model, 'translator.json')):
    sys.exit(f'error: {args.model} is not a folder written by export.py --format jax.')
  if args.http is not None and not 0 <= args.http <= 65535:
    sys.exit(f'error: --http {args.http}: a port is a number from 0 to 65535.')
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
      lines = read_lines(args.input)
    except (OSError, ValueError) as error:
      sys.exit(f'error: {error}')
  if not jax.config.jax_compilation_cache_dir:  # Later runs load the compiled programs.
    jax.config.update('jax_compilation_cache_dir', os.path.join(args.model, 'compilation_cache'))
  try:
    translator = ExportedTranslator(args.model)
  except (ImportError, OSError, ValueError) as error:
    sys.exit(f'error: {error}')
  if args.http is not None:
    try:
      server = make_http_server(translator, args.host, args.http)
    except OSError as error:  # The port is taken, or the address is not this machine's.
      sys.exit(f'error: cannot serve on {args.host}:{args.http}: {error.strerror or error}.')
    print(f'Serving http://{args.host}:{server.server_port}/translate', file=sys.stderr,
          flush=True)
    try:
      server.serve_forever()
    except KeyboardInterrupt:
      pass
    return
  try:
    out = sys.stdout if args.output == '-' else open(args.output, 'w', encoding='utf-8')
  except OSError as error:
    sys.exit(f'error: {error}')
  if streaming:
    line_number = 1
    try:
      for chunk in stream_lines(sys.stdin.fileno()):
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
