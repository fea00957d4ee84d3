"""The HTTP server of `serving.py --http`: POST /translate (JSON), GET /health, GET / (the page
`serving_page.html` beside this file), limits and bad input as JSON errors, an access log, and
draining on shutdown; the translations run in a `serving_batcher.Batcher`.

It lives in `nmt/` in a checkout; `export.py` copies it flat into the exported folder, beside
`serving.py`, so it imports only the standard library, `serving_translator` and
`serving_batcher`.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

if __package__:  # nmt/ in a checkout
  from nmt.serving_batcher import Batcher, Busy
  from nmt.serving_translator import ExportedTranslator, output_line
else:  # flat in an exported folder
  from serving_batcher import Batcher, Busy
  from serving_translator import ExportedTranslator, output_line

# What the HTTP server accepts by default (flags of the same names change them).
MAX_BODY_BYTES = 10 * 1024 * 1024  # The largest POST body the server reads (413 beyond it).
MAX_SENTENCES = 256  # Sentences per request (413 beyond).
MAX_CHARACTERS = 2000  # Characters per sentence (413 beyond).
MAX_CONNECTIONS = 512  # Open connections, each with a thread (503 beyond).
MAX_QUEUED_SENTENCES = 4096  # Sentences waiting for the batcher (503 beyond).
BATCH_SENTENCES = 128  # Sentences translated together at most (the CPU's continuous slots).
READ_TIMEOUT_SECONDS = 60.0  # How long the server waits for a client's next bytes.


class _Limits:
  """What the HTTP server accepts (command-line flags)."""

  def __init__(self, max_sentences: int, max_characters: int, max_body_bytes: int,
               max_connections: int):
    self.max_sentences, self.max_characters = max_sentences, max_characters
    self.max_body_bytes, self.max_connections = max_body_bytes, max_connections


class RequestError(Exception):
  """A request the server refuses: its HTTP status and a one-line message."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


REQUEST_FIELDS = ('text', 'details', 'nbest', 'attention')


def parse_request(body: bytes, limits: _Limits, beam_size: int) -> dict[str, Any]:
  """A POST /translate body as {'text': [...], 'details', 'nbest', 'attention'}; a
  RequestError (400, or 413 over a limit) names what is wrong.

  The body is a UTF-8 JSON object: "text" a string or a list of strings (required),
  "details" true for scores, pieces, log-probabilities and alignments, "nbest" (1 to the
  beam size) for that many translations, "attention" true for the attention matrices too
  (either implies "details").
  """
  shape = 'expected a JSON body {"text": ["sentence", ...]}'
  try:
    request = json.loads(body.decode('utf-8'))
  except UnicodeDecodeError as error:
    raise RequestError(400, f'the body is not UTF-8 ({error.reason} at byte '
                            f'{error.start}): send UTF-8 JSON') from None
  except RecursionError:
    raise RequestError(400, f'{shape}: the JSON nests too deeply') from None
  except ValueError as error:
    raise RequestError(400, f'{shape}: the body is not JSON ({error})') from None
  if not isinstance(request, dict):
    raise RequestError(400, f'{shape}: got a JSON {type(request).__name__}, not an object')
  unknown = sorted(set(request) - set(REQUEST_FIELDS))
  if unknown:
    raise RequestError(400, f'{shape}: unknown field {unknown[0]!r} (known: '
                            f'{", ".join(REQUEST_FIELDS)})')
  if 'text' not in request:
    raise RequestError(400, f'{shape}: the field "text" is missing')
  text = request['text']
  text = [text] if isinstance(text, str) else text
  if not isinstance(text, list):
    raise RequestError(400, f'{shape}: "text" is a {type(text).__name__}, not a string or '
                            'a list of strings')
  if len(text) > limits.max_sentences:
    raise RequestError(413, f'the request has {len(text)} sentences; at most '
                            f'{limits.max_sentences} are translated per request')
  for index, sentence in enumerate(text):
    if not isinstance(sentence, str):
      raise RequestError(400, f'{shape}: text[{index}] is a {type(sentence).__name__}, not '
                              'a string')
    if len(sentence) > limits.max_characters:
      raise RequestError(413, f'text[{index}] has {len(sentence)} characters; at most '
                              f'{limits.max_characters} per sentence')
    try:
      sentence.encode('utf-8')
    except UnicodeEncodeError:
      raise RequestError(400, f'text[{index}] holds a lone surrogate (such as \\ud800): send '
                              'Unicode text') from None
  nbest = request.get('nbest', 1)
  if isinstance(nbest, bool) or not isinstance(nbest, int) or not 1 <= nbest <= beam_size:
    raise RequestError(400, f'"nbest" must be an integer from 1 to the beam size '
                            f'{beam_size}, got {json.dumps(nbest)}')
  flags = {}
  for name in ('details', 'attention'):
    flags[name] = request.get(name, False)
    if not isinstance(flags[name], bool):
      raise RequestError(400, f'"{name}" must be true or false, got {json.dumps(flags[name])}')
  return dict(text=text, nbest=nbest, attention=flags['attention'],
              details=flags['details'] or flags['attention'] or 'nbest' in request)


def _printable(text: str) -> str:
  """`text` on one line of the access log: control characters escaped."""
  return ''.join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class TranslationServer(ThreadingHTTPServer):
  """An HTTP server translating with a `Batcher`: see `make_http_server`.

  It tracks its connections: each is 'idle' (no request read yet) or 'busy' (a request being
  read, translated or answered), so that `drain` can let every request it has begun finish.
  """

  daemon_threads = True
  request_queue_size = 1024  # Connections the kernel holds until accepted (a burst of them).

  def __init__(self, address: tuple[str, int], handler: type, batcher: Batcher,
               limits: _Limits, page: bytes | None, log: Any):
    # Before binding: a failed bind calls server_close, which stops the batcher.
    self.batcher, self.limits, self.page, self.log = batcher, limits, page, log
    self._connections: dict[Any, str] = {}
    self._lock = threading.Lock()
    self.draining = False
    super().__init__(address, handler)

  def process_request(self, request, client_address):
    with self._lock:
      full = len(self._connections) >= self.limits.max_connections
      if not full:
        self._connections[request] = 'idle'
    if not full:
      return super().process_request(request, client_address)
    # Over the limit: a JSON 503 at once, from this thread (no thread started for it).
    body = json.dumps({'error': f'the server has {self.limits.max_connections} connections '
                                'open: try again later'}).encode()
    try:
      request.settimeout(1.0)
      request.sendall(b'HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n'
                      b'Retry-After: 1\r\nConnection: close\r\n'
                      + f'Content-Length: {len(body)}\r\n\r\n'.encode() + body)
    except OSError:
      pass  # The client is gone.
    self.log_line(client_address[0], 'connection', 503, 0, 0.0)
    self.shutdown_request(request)

  def shutdown_request(self, request):
    with self._lock:
      self._connections.pop(request, None)
    super().shutdown_request(request)

  def mark(self, request: Any, state: str) -> None:
    with self._lock:
      if request in self._connections:
        self._connections[request] = state

  @property
  def connections(self) -> dict[str, int]:
    """How many connections are idle and busy."""
    with self._lock:
      states = list(self._connections.values())
    return {state: states.count(state) for state in ('idle', 'busy')}

  def handle_error(self, request, client_address):
    """One line, not a traceback: most are clients that left mid-answer."""
    error = sys.exc_info()[1]
    self.log.write(f'{client_address[0]} error: {type(error).__name__}: {error}\n')
    self.log.flush()

  def log_line(self, client: str, request: str, status: int | str, sentences: int,
               milliseconds: float) -> None:
    """The access log: one line per request."""
    self.log.write(f'{client} {request} {status} sentences={sentences} '
                   f'ms={milliseconds:.1f}\n')
    self.log.flush()

  def stop_accepting(self) -> None:
    """Call after serve_forever has returned: the connections already waiting in the listen
    queue (made before the server stopped) are taken like any other; later ones are refused."""
    self.socket.setblocking(False)
    while True:
      try:
        request, address = self.socket.accept()
      except OSError:  # None left (BlockingIOError) or the socket is gone.
        break
      self.process_request(request, address)
    self.draining = True
    self.socket.close()

  def drain(self) -> None:
    """After stop_accepting: lets every request already begun finish and be answered, closes
    the connections that sent nothing yet, then stops the batcher."""
    while True:
      with self._lock:
        idle = [r for r, state in self._connections.items() if state == 'idle']
        busy = sum(state == 'busy' for state in self._connections.values())
      for request in idle:  # Nothing read from it yet: a request waiting in it is let in.
        try:
          if not select.select([request], [], [], 0)[0]:
            request.shutdown(socket.SHUT_RDWR)
        except (OSError, ValueError):
          pass
      if not busy and not idle:
        break
      time.sleep(0.02)
    self.batcher.stop()

  def server_close(self):
    super().server_close()
    self.batcher.stop()


def _load_page() -> bytes | None:
  """The page served at GET /, from serving_page.html beside this file (None without it)."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'serving_page.html')
  try:
    with open(path, 'rb') as f:
      return f.read()
  except OSError:
    return None


def make_http_server(translator: ExportedTranslator, host: str, port: int, *,
                     max_sentences: int = MAX_SENTENCES, max_characters: int = MAX_CHARACTERS,
                     max_body_bytes: int = MAX_BODY_BYTES,
                     max_connections: int = MAX_CONNECTIONS,
                     batch_sentences: int = BATCH_SENTENCES, batch_tokens: int | None = None,
                     max_queued_sentences: int = MAX_QUEUED_SENTENCES,
                     pool: bool = True, pool_steps: int = 2, warm_up: bool = False,
                     log: Any = None) -> TranslationServer:
  """An HTTP server (call serve_forever) translating with `translator`; port 0 picks a free
  one.

    POST /translate {"text": [...]}   -> {"translations": [...]}, in the request's order; with
        "details": true, "nbest": N or "attention": true also {"details": per sentence its
        translations' dicts (`ExportedTranslator.translate_details`)}.
    GET /health  -> {"status": "ok" (503 "draining" while shutting down), queue and counts}.
    GET /        -> the page: type sentences, see translations, n-best lists and attention.

  Each connection has its own thread (a slow client holds up no other); the translations of
  every request run in one `Batcher` thread: with `pool` (and a CPU export), plain requests'
  sentences join the slot pool's running search (`pool_steps` steps per call between
  admissions), the others, and all without it, are translated in batches of the requests that
  arrived while the last batch translated (up to `batch_sentences` sentences and
  `batch_tokens` source tokens). `warm_up` compiles the pool's programs before returning.
  Errors are JSON {"error": ...}: 400 for a body that is not such a request, 404 for another
  path, 405 for another method, 408 for a body that does not arrive within
  READ_TIMEOUT_SECONDS, 411 without a Content-Length, 413 over `max_body_bytes`, over
  `max_sentences` sentences or over `max_characters` characters in a sentence, 503 while more
  than `max_queued_sentences` wait or `max_connections` are open (Retry-After: 1). One
  access-log line per request goes to `log` (default stderr): client, request, status,
  sentences, milliseconds.
  """
  limits = _Limits(max_sentences, max_characters, max_body_bytes, max_connections)
  batcher = Batcher(translator, batch_sentences, batch_tokens, max_queued_sentences, pool,
                    pool_steps)
  if warm_up and batcher.pool is not None:
    batcher.pool.warm_up()
  page = _load_page()

  class Handler(BaseHTTPRequestHandler):
    # Persistent connections: a client's next request skips the connect and the new thread.
    protocol_version = 'HTTP/1.1'
    # TCP_NODELAY: an answer's body goes out at once, not after the client's delayed ACK of its
    # headers (tens of milliseconds on a connection kept open).
    disable_nagle_algorithm = True
    timeout = READ_TIMEOUT_SECONDS  # Socket reads: a client that stops sending is let go.
    server: TranslationServer
    answered = 0  # Requests answered on this connection.

    def handle_one_request(self):
      """One request, then its access-log line; the connection is 'busy' in between."""
      self.sentences, self.status, self.started = 0, None, None
      self.raw_requestline, self.body_read = b'', False
      if self.server.draining and not select.select([self.connection], [], [], 0)[0]:
        self.close_connection = True  # Shutting down, and no request has arrived on it.
        return
      try:
        super().handle_one_request()
      finally:
        if self.started is None and self.raw_requestline:  # Refused before parse_request.
          self.started = time.monotonic()
        if self.started is not None:
          request = _printable(self.requestline or repr(self.raw_requestline[:80]))
          self.server.log_line(self.client_address[0], f'"{request}"',
                               self.status or 'dropped', self.sentences,
                               1000 * (time.monotonic() - self.started))
        self.server.mark(self.connection, 'idle')
        self.answered += self.status is not None

    def parse_request(self):  # Called once the request line has arrived.
      self.started = time.monotonic()
      self.server.mark(self.connection, 'busy')
      return super().parse_request()

    def route(self) -> str:
      return urllib.parse.urlsplit(self.path).path.rstrip('/') or '/'

    def do_POST(self):  # noqa: N802 (http.server's name)
      path = self.route()
      if path in ('/', '/health'):
        return self.not_allowed('GET')
      if path != '/translate':
        return self.reply(404, {'error': f'no such path {path}: POST to /translate'})
      if 'chunked' in (self.headers.get('Transfer-Encoding') or '').lower():
        self.close_connection = True
        return self.reply(411, {'error': 'send the body with a Content-Length, not chunked'})
      try:
        length = int(self.headers.get('Content-Length') or 0)
      except ValueError:
        length = -1
      if length < 0:
        self.close_connection = True
        return self.reply(400, {'error': 'the Content-Length is not a number of bytes'})
      if length > limits.max_body_bytes:
        self.close_connection = True  # Its body stays unread.
        return self.reply(413, {'error': f'the body has {length} bytes; at most '
                                         f'{limits.max_body_bytes} are read.'})
      try:
        body = self.rfile.read(length)
      except TimeoutError:
        self.close_connection = True
        return self.reply(408, {'error': f'the body did not arrive within {self.timeout} s.'})
      except OSError:  # The connection broke: no one to answer.
        self.close_connection = True
        return
      if len(body) < length:  # The client left before sending its body: no one to answer.
        self.close_connection = True
        return
      self.body_read = True
      try:
        request = parse_request(body, limits, translator.beam_size)
        if request['details'] and not translator.has_details:
          raise RequestError(400, 'this model folder has no n-best or forced decoding '
                                  'programs: export it again for "details", "nbest" or '
                                  '"attention"')
      except RequestError as error:
        return self.reply(error.status, {'error': str(error)})
      self.sentences = len(request['text'])
      try:
        job = batcher.submit(request['text'], request['details'], request['nbest'],
                             request['attention'])
      except Busy as busy:
        return self.reply(503, {'error': f'{busy}: try again later'}, **{'Retry-After': '1'})
      job.done.wait()
      if job.error is not None:
        return self.reply(500, {'error': f'the translation failed: '
                                         f'{type(job.error).__name__}: {job.error}'})
      if request['details']:
        for outputs in job.result:
          for output in outputs:
            output['text'] = output_line(output['text'])
        translations = [outputs[0]['text'] if outputs else '' for outputs in job.result]
        return self.reply(200, {'translations': translations, 'details': job.result})
      self.reply(200, {'translations': [output_line(t) for t in job.result]})

    def do_GET(self):  # noqa: N802 (http.server's name)
      path = self.route()
      if path == '/health':
        draining = self.server.draining
        return self.reply(503 if draining else 200, {
            'status': 'draining' if draining else 'ok',
            'queued_sentences': batcher.queued_sentences,
            'connections': self.server.connections, 'batches': batcher.batches,
            'sentences': batcher.sentences, 'searches': translator.searches,
            'pool': batcher.pool and {
                'slots': len(batcher.pool.owners), 'running': batcher.pool.running,
                'admissions': batcher.pool.admissions, 'admitted': batcher.pool.admitted},
            'beam_size': translator.beam_size, 'details': translator.has_details,
            'max_sentences': limits.max_sentences, 'max_characters': limits.max_characters})
      if path == '/':
        if page is None:
          return self.reply(404, {'error': 'this folder has no serving_page.html: copy the '
                                           'whole folder written by export.py'})
        return self.send(200, page, 'text/html; charset=utf-8')
      if path == '/translate':
        return self.not_allowed('POST')
      self.reply(404, {'error': f'no such path {path}: POST to /translate, GET / or /health'})

    def do_PUT(self):  # noqa: N802 (http.server's name)
      path = self.route()
      if path in ('/translate', '/', '/health'):
        return self.not_allowed('POST' if path == '/translate' else 'GET')
      self.reply(404, {'error': f'no such path {path}: POST to /translate'})

    do_DELETE = do_PATCH = do_PUT

    def not_allowed(self, allowed: str) -> None:
      self.close_connection = True  # A body it may have stays unread.
      self.reply(405, {'error': f'{self.command} is not allowed on {self.route()}: '
                                f'{allowed} it'}, Allow=allowed)

    def send_error(self, code, message=None, explain=None):
      """http.server's own errors (a malformed request line, headers, an unknown method) as
      JSON like the others."""
      self.close_connection = True
      if self.request_version == 'HTTP/0.9':  # A request line it could not read: answer 1.0.
        self.request_version = 'HTTP/1.0'
      status = HTTPStatus(code)
      self.reply(code, {'error': f'{status.phrase}: {message or status.description}'})

    def reply(self, status: int, body: dict, **headers: str) -> None:
      self.send(status, json.dumps(body, ensure_ascii=False).encode('utf-8'),
                'application/json; charset=utf-8', **headers)

    def body_unread(self) -> bool:
      """Whether the request declared a body that was not read (it would be taken for the
      connection's next request)."""
      headers = getattr(self, 'headers', None)
      if headers is None or self.body_read:
        return False
      return bool(headers.get('Transfer-Encoding')) or (
          headers.get('Content-Length') or '0').strip() != '0'

    def send(self, status: int, data: bytes, content_type: str, **headers: str) -> None:
      self.status = status
      if self.server.draining or self.body_unread():
        self.close_connection = True
      self.send_response(status)
      if self.close_connection:  # The client knows not to send another request on it.
        self.send_header('Connection', 'close')
      self.send_header('Content-Type', content_type)
      self.send_header('Content-Length', str(len(data)))
      for name, value in headers.items():
        self.send_header(name, value)
      try:
        self.end_headers()
        if self.command != 'HEAD':
          self.wfile.write(data)
      except OSError:  # The client left before its answer: the access log says so.
        self.status = f'{status}-unsent'
        self.close_connection = True

    def log_request(self, code='-', size='-'):
      pass  # handle_one_request writes the request's line, with its sentences and time.

    def log_error(self, format, *args):  # noqa: A002 (http.server's signature)
      if self.answered and not self.raw_requestline and format.startswith('Request timed out'):
        return  # A persistent connection left idle: its end is no error.
      self.log_message(format, *args)

    def log_message(self, format, *args):  # noqa: A002 (http.server's signature)
      self.server.log.write(f'{self.client_address[0]} {format % args}\n')
      self.server.log.flush()

  return TranslationServer((host, port), Handler, batcher, limits, page, log or sys.stderr)


