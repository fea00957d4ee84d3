"""serving.py --http: batched serving (concurrent requests share a search), the details API
(n-best, scores, alignments, attention from the exported forced decoding, checked against the
model's own full forward pass), limits and bad input as JSON errors, /health, the access log,
and SIGTERM draining every request begun."""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
from test_export_jax import isolated

from model.forced_decoding import attention_maps
from nmt import runs, sharding, text_io
from nmt import translator as translator_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def val_lines(count: int, start: int = 0) -> list[str]:
  lines = text_io.read_lines(os.path.join(os.environ['MULTI30K_DIR'], 'val.en'))
  return lines[start:start + count]


@pytest.fixture(scope='module')
def serving_module(exported_jax):
  """The exported folder's serving.py, imported (with its flat copies of serving_translator,
  serving_batcher and serving_http)."""
  sys.path.insert(0, exported_jax)
  try:
    import serving
    return serving
  finally:
    sys.path.remove(exported_jax)


@pytest.fixture(scope='module')
def translator(serving_module, exported_jax):
  return serving_module.ExportedTranslator(exported_jax)


class Server:
  """make_http_server(...) serving in a thread; its access log kept in memory."""

  def __init__(self, serving_module, translator, **kwargs):
    self.log = LogLines()
    self.http = serving_module.make_http_server(translator, '127.0.0.1', 0, log=self.log,
                                                **kwargs)
    self.port = self.http.server_port
    self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
    self.thread.start()

  def request(self, path, body=None, method=None, timeout=300, headers=None):
    """(status, JSON body, headers) of a request; body: bytes or a JSON-able object."""
    if body is not None and not isinstance(body, bytes):
      body = json.dumps(body).encode()
    request = urllib.request.Request(f'http://127.0.0.1:{self.port}{path}', data=body,
                                     method=method or ('GET' if body is None else 'POST'),
                                     headers=headers or {})
    try:
      with urllib.request.urlopen(request, timeout=timeout) as response:
        data = response.read()
        kind = response.headers['Content-Type']
        return response.status, json.loads(data) if 'json' in kind else data, response.headers
    except urllib.error.HTTPError as error:
      return error.code, json.loads(error.read()), error.headers

  def raw(self, data: bytes, timeout=60) -> bytes:
    """What the server answers to `data` sent as is, until it closes the connection."""
    with socket.create_connection(('127.0.0.1', self.port), timeout=timeout) as client:
      client.sendall(data)
      return b''.join(iter(lambda: client.recv(1 << 16), b''))

  def close(self):
    self.http.shutdown()
    self.http.server_close()


class LogLines:
  """A file-like log writer keeping its lines."""

  def __init__(self):
    self.text = ''
    self.lock = threading.Lock()

  def write(self, text):
    with self.lock:
      self.text += text

  def flush(self):
    pass

  def lines(self, at_least: int = 0, timeout: float = 30):
    """The lines so far, once there are `at_least` (a handler writes its request's line just
    after the answer has gone)."""
    deadline = time.monotonic() + timeout
    while True:
      with self.lock:
        lines = self.text.splitlines()
      if len(lines) >= at_least or time.monotonic() > deadline:
        return lines
      time.sleep(0.01)


@pytest.fixture
def server(serving_module, translator):
  server = Server(serving_module, translator)
  yield server
  server.close()


def json_error(reply: bytes, status: int) -> str:
  """The error message of a raw HTTP reply with `status` and a JSON body."""
  head, _, body = reply.partition(b'\r\n\r\n')
  assert re.match(rb'HTTP/1\.[01] %d ' % status, head), reply[:300]
  assert b'application/json' in head, head
  return json.loads(body)['error']


def cross_attention(model, params, sources, targets) -> list[np.ndarray]:
  """Per pair of token ids, the cross-attention of one teacher-forced pass [target, source],
  averaged over the decoder's layers and heads (`model.forced_decoding.attention_maps`, as
  plot_attention.py reads it): the pairs padded into one batch, one jitted call (padding
  positions get no weight, and a target row sees only the pieces before it)."""
  def padded(rows):
    array = np.zeros((len(rows), max(len(row) for row in rows)), np.int32)
    for i, row in enumerate(rows):
      array[i, :len(row)] = row
    return array

  maps = jax.jit(lambda p, x, y: attention_maps(model, p, x, y)[1]['cross_attention'])(
      params, padded(sources), padded(targets))
  mean = np.mean([np.asarray(w).mean(axis=1) for w in maps], axis=0)  # [pair, target, source]
  return [mean[i, :len(y), :len(x)] for i, (x, y) in enumerate(zip(sources, targets))]


def test_details_equal_decode_and_the_forward_pass(trained_run, translator):
  """translate_details: the n-best lists and scores of decode.py's Translator with the same
  nbest (texts equal, scores within 1e-4), token log-probabilities equal to its search's, and
  alignments and attention from the run's own teacher-forced forward pass."""
  lines = val_lines(5) + ['', 'Hi.']
  config, tokenizer, model = runs.load_run(trained_run)
  mesh = sharding.make_mesh()
  params, _ = runs.load_params(trained_run, mesh)
  beam = config.decode.beam_size
  for nbest in (1, beam):
    decoder = translator_lib.Translator(model, tokenizer, config.decode, mesh, nbest=nbest,
                                        details=True)
    expected = decoder(params, lines)
    got = translator.translate_details(lines, nbest=nbest, attention=True)
    assert got[5] == [] and expected[5] == []
    for ours, theirs in zip(got, expected):
      assert [o['text'] for o in ours] == [t['text'] for t in theirs]
      assert [o['tokens'] for o in ours] == [t['tokens'] for t in theirs]
      np.testing.assert_allclose([o['score'] for o in ours], [t['score'] for t in theirs],
                                 atol=1e-4)
      for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o['token_log_probs'], t['token_log_probs'], atol=1e-4)
        assert o['log_prob'] == pytest.approx(sum(o['token_log_probs']), abs=1e-4)
  best = translator.translate_details(lines, nbest=1, attention=True)
  assert [d[0]['text'] if d else '' for d in best] == translator.translate(lines)
  params = jax.device_get(params)
  pieces = tokenizer.pieces()
  piece_ids = {p: i for i, p in enumerate(pieces)}
  sources = tokenizer.encode(lines[:5])
  targets = [[piece_ids[p] for p in output['tokens']] for (output,) in best[:5]]
  for source, (output,), mean in zip(sources, best[:5],
                                     cross_attention(model, params, sources, targets)):
    assert output['source_tokens'] == [pieces[t] for t in source]
    np.testing.assert_allclose(output['attention'], mean, atol=1e-4)
    assert output['align'] == [int(i) for i in mean.argmax(axis=1)]


def requests_behind_a_held_one(server, lines, held) -> tuple[dict, list]:
  """Sends lines[0] and waits until its translation is held (`held` set), then every other
  line as its own request, and waits until all of those are queued: (results by line index,
  filled as answers come; the client threads)."""
  results = {}

  def client(i):
    results[i] = server.request('/translate', {'text': [lines[i]]})[:2]

  clients = [threading.Thread(target=client, args=(0,))]
  clients[0].start()
  assert held.wait(120)
  clients += [threading.Thread(target=client, args=(i,)) for i in range(1, len(lines))]
  for thread in clients[1:]:
    thread.start()
  deadline = time.monotonic() + 60
  while server.http.batcher.queued_sentences < len(lines) - 1:
    assert time.monotonic() < deadline, server.http.batcher.queued_sentences
    time.sleep(0.01)
  return results, clients


def test_pool_admits_requests_that_arrive_together(serving_module, translator):
  """The slot pool: with its first call held, 12 one-sentence requests queue, then one
  admission starts all 12 in the running search (no request waits for another's end), and
  each response holds decode.py's translation of its own sentence."""
  lines = val_lines(12, start=20)
  expected = translator.translate(lines)
  server = Server(serving_module, translator)
  pool = server.http.batcher.pool
  held, release = threading.Event(), threading.Event()
  original = pool.step

  def step():
    if not held.is_set():
      held.set()
      assert release.wait(120)
    return original()

  pool.step = step
  try:
    results, clients = requests_behind_a_held_one(server, lines, held)
    assert (pool.admissions, pool.admitted) == (1, 1)
    release.set()
    for thread in clients:
      thread.join(120)
    assert (pool.admissions, pool.admitted) == (2, len(lines))
    assert results == {i: (200, {'translations': [expected[i]]}) for i in range(len(lines))}
    status, health, _ = server.request('/health')
    assert status == 200 and health['pool']['admitted'] == len(lines)
    assert health['pool']['running'] == 0 and health['queued_sentences'] == 0
  finally:
    server.close()


def test_pool_translates_as_decode(serving_module, translator):
  """Many sentences through the slot pool, a few at a time, its size growing and shrinking:
  each translation equals decode.py's (the batch search's)."""
  lines = val_lines(40, start=200) + ['']
  expected = translator.translate(lines)
  batcher = serving_module.serving_batcher.Batcher(translator)
  sizes = []
  original = batcher.pool.step
  batcher.pool.step = lambda: (sizes.append(len(batcher.pool.owners)), original())[1]
  starts = []  # (start width, the longest admitted sentence's tokens) per admission.
  call_tree = translator._call_tree

  kept = []  # Shapes of state arrays a put or step did not consume (donation not aliased).

  def record(name, *args):
    if name.startswith('pool_start_'):
      starts.append((int(name.rsplit('_', 1)[1]), int((args[0] != translator.pad_id).sum(1).max())))
    result = call_tree(name, *args)
    if name.startswith(('pool_put_', 'pool_step_')):
      kept.extend(x.shape for x in jax.tree_util.tree_leaves(args[0]) if not x.is_deleted())
    return result

  translator._call_tree = record
  try:
    results = []
    for start, end in ((0, 30), (30, 32), (32, len(lines))):
      jobs = [batcher.submit(lines[i:min(i + 3, end)]) for i in range(start, end, 3)]
      for job in jobs:
        assert job.done.wait(300)
        results += job.result
    assert results == expected
    # Requests with a sentence longer than the pool's width are translated in batches.
    pooled = sum(sum(1 for x in lines[i:min(i + 3, end)] if x)
                 for start, end in ((0, 30), (30, 32), (32, len(lines)))
                 for i in range(start, end, 3)
                 if all(len(x) <= batcher.pool.width for x in translator.encode(
                     lines[i:min(i + 3, end)])))
    assert 0 < batcher.pool.admitted == pooled < len(lines) + 1
    # The pool grew for the first 30 sentences, shrank for the next 2, grew for the rest.
    top = sizes.index(max(sizes))
    low = top + sizes[top:].index(min(sizes[top:]))
    assert max(sizes) >= 16 and sizes[low] <= 4 and max(sizes[low:]) >= 8, sizes
    # Each admission is encoded in the narrowest start width that holds its longest sentence,
    # and both narrow starts (padded to the pool's width) and wider ones translated above.
    widths = batcher.pool.start_widths
    assert all(width == min(w for w in widths if w >= longest) for width, longest in starts)
    assert len({width for width, _ in starts}) >= 2, (starts, widths)
    # Puts and steps update the pool's state in place: XLA aliased every donated array.
    assert not kept, kept
  finally:
    translator._call_tree = call_tree
    batcher.stop()


def test_pool_warm_up_compiles_what_requests_run(serving_module, translator):
  """After warm_up (here on the pool's three smallest sizes), admitting, stepping, growing and
  shrinking the pool compile nothing more."""
  lines = val_lines(4, start=300)
  expected = translator.translate(lines)
  batcher = serving_module.serving_batcher.Batcher(translator)
  pool = batcher.pool
  pool.sizes = pool.sizes[:3]
  try:
    pool.warm_up()
    batcher_module = serving_module.serving_batcher
    jitted = [batcher_module._concatenate_slots,
              batcher_module._take_slots, *translator._jitted.values()]
    compiled = [f._cache_size() for f in jitted]
    results = [batcher.submit(lines[:3]), batcher.submit(lines[3:])]
    for job in results:
      assert job.done.wait(300)
    one = batcher.submit(lines[:1])  # The pool shrinks from 4 slots to 1.
    assert one.done.wait(300)
    assert results[0].result + results[1].result + one.result == expected + expected[:1]
    assert [f._cache_size() for f in jitted] == compiled
  finally:
    batcher.stop()


def test_batches_share_one_search(serving_module, translator):
  """Without the pool, requests that arrive while a batch translates are translated together
  in the next batch: with the first batch held, 12 one-sentence requests queue, then one
  search translates all 12, and each response holds its own sentence's translation."""
  lines = val_lines(12, start=20)
  expected = translator.translate(lines)
  held, release = threading.Event(), threading.Event()
  batches = []
  original = translator.translate

  def translate(sources, first_line=1):
    batches.append(len(sources))
    if len(batches) == 1:
      held.set()
      assert release.wait(120)
    return original(sources, first_line)

  translator.translate = translate
  server = Server(serving_module, translator, pool=False)
  try:
    results, clients = requests_behind_a_held_one(server, lines, held)
    searches = translator.searches
    release.set()
    for thread in clients:
      thread.join(120)
    assert batches == [1, len(lines) - 1]
    assert translator.searches == searches + 2  # The held batch's, then one for the rest.
    assert results == {i: (200, {'translations': [expected[i]]}) for i in range(len(lines))}
    status, health, _ = server.request('/health')
    assert status == 200 and health['status'] == 'ok' and health['batches'] == 2
    assert health['sentences'] == len(lines) and health['queued_sentences'] == 0
  finally:
    translator.translate = original
    server.close()


def test_batch_budget_in_sentences_and_tokens(serving_module, translator):
  """A batch takes queued requests oldest first up to batch_sentences and batch_tokens; the
  oldest is taken even over the budget."""
  lines = val_lines(6, start=40)
  tokens = [translator.count_tokens([line]) for line in lines]
  batcher_class = serving_module.serving_batcher.Batcher
  batcher = batcher_class.__new__(batcher_class)
  batcher.translator, batcher.batch_sentences = translator, 3
  batcher.batch_tokens = tokens[0] + tokens[1] + tokens[2] + 1
  batcher._queue, batcher._queued_sentences, batcher._waiting = [], 0, []
  batcher._condition, batcher._stopping = threading.Condition(), False
  batcher.max_queued_sentences = 100
  ids = translator.encode(lines)
  job_class = serving_module.serving_batcher.Job
  jobs = [job_class([line], [x], False, 1, False) for line, x in zip(lines, ids)]
  big = job_class(lines, ids, False, 1, False)
  batcher._queue = [big, *jobs]
  batcher._queued_sentences = 12
  assert batcher._take(wait=True) == [big]  # Over both budgets, and taken alone.
  assert batcher._take(wait=True) == jobs[:3]  # Three sentences.
  batcher.batch_sentences = 10
  batcher.batch_tokens = tokens[3] + tokens[4]
  assert batcher._take(wait=True) == jobs[3:5]  # The tokens budget.
  assert batcher._take(wait=True) == jobs[5:] and batcher.queued_sentences == 0


def test_details_over_http(server, translator):
  lines = val_lines(3, start=60) + ['']
  status, body, _ = server.request('/translate', {'text': lines, 'nbest': 2,
                                                  'attention': True})
  expected = translator.translate_details(lines, nbest=translator.beam_size, attention=True)
  assert status == 200 and body['details'][3] == []
  assert body['details'] == [json.loads(json.dumps(d[:2])) for d in expected]
  assert body['translations'] == [d[0]['text'] if d else '' for d in expected]
  status, body, _ = server.request('/translate', {'text': lines, 'details': True})
  assert status == 200 and body['translations'] == translator.translate(lines)
  assert all('attention' not in d[0] and len(d) == 1 for d in body['details'][:3])
  assert all(len(d[0]['align']) == len(d[0]['tokens']) for d in body['details'][:3])


def test_bad_input_gets_json_errors(server, serving_module):
  """Malformed JSON, wrong types, nested lists, deep nesting, huge arrays, long sentences,
  invalid UTF-8, bad options, chunked bodies, garbage request lines: each a JSON error with
  its status, and the server answers a good request after them."""
  limit = serving_module.serving_http.MAX_SENTENCES
  cases = [
      (b'{"text": ', 400, 'not JSON'),
      (b'[1, 2]', 400, 'not an object'),
      (b'"A dog."', 400, 'not an object'),
      (b'{}', 400, '"text" is missing'),
      (b'{"text": 5}', 400, '"text" is a int'),
      (b'{"text": null}', 400, '"text" is a NoneType'),
      (b'{"text": [["A dog."]]}', 400, 'text[0] is a list'),
      (b'{"text": ["A dog.", {"a": 1}]}', 400, 'text[1] is a dict'),
      (b'[' * 100000 + b']' * 100000, 400, 'nests too deeply'),
      (json.dumps({'text': ['x'] * (limit + 1)}).encode(), 413, f'at most {limit}'),
      (json.dumps({'text': ['x' * 2001]}).encode(), 413, 'text[0] has 2001 characters'),
      (b'{"text": ["Caf\xe9"]}', 400, 'not UTF-8'),
      (b'{"text": ["A"], "nbest": 0}', 400, '"nbest" must be an integer from 1'),
      (b'{"text": ["A"], "nbest": 99}', 400, '"nbest" must be an integer from 1'),
      (b'{"text": ["A"], "nbest": true}', 400, '"nbest"'),
      (b'{"text": ["A"], "attention": "yes"}', 400, '"attention" must be true or false'),
      (b'{"text": ["A"], "txt": 1}', 400, "unknown field 'txt'"),
  ]
  for body, status, fragment in cases:
    got, reply, _ = server.request('/translate', body)
    assert got == status and fragment in reply['error'], (body[:60], got, reply)
  for data, status, fragment in [
      (b'POST /translate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n',
       411, 'Content-Length'),
      (b'POST /translate HTTP/1.1\r\nContent-Length: -5\r\n\r\n', 400, 'Content-Length'),
      (b'GARBAGE\r\n\r\n', 400, 'Bad'),
      (b'GET /' + b'a' * 70000 + b' HTTP/1.1\r\n\r\n', 414, 'URI'),
      (b'BREW /translate HTTP/1.1\r\n\r\n', 501, 'BREW'),
      (b'GET /nothing HTTP/1.1\r\nConnection: close\r\n\r\n', 404, 'no such path'),
      (b'POST /health HTTP/1.1\r\nContent-Length: 0\r\n\r\n', 405, 'GET it'),
  ]:
    assert fragment in json_error(server.raw(data), status), data[:60]
  status, body, _ = server.request('/translate', {'text': ['', '  ', 'A dog runs.']})
  assert status == 200 and body['translations'][:2] == ['', '']


def test_persistent_connections(server, translator):
  """An HTTP/1.1 client keeps its connection from one request to the next; an answer that
  leaves the request's body unread says 'Connection: close' and closes it."""
  lines = val_lines(3, start=60)
  connection = http.client.HTTPConnection('127.0.0.1', server.port, timeout=300)
  try:
    sockets, replies = [], []
    for line in lines:
      connection.request('POST', '/translate', json.dumps({'text': [line]}),
                         {'Content-Type': 'application/json'})
      sockets.append(connection.sock)
      response = connection.getresponse()
      replies.append((response.status, json.loads(response.read()),
                      response.getheader('Connection')))
    assert sockets[0] is not None and sockets == [sockets[0]] * 3
    # The server's end sends at once (TCP_NODELAY): else each answer's body waits for the
    # client's delayed ACK of its headers on a connection kept open.
    with server.http._lock:
      (open_connection,) = server.http._connections
    assert open_connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    assert replies == [(200, {'translations': translator.translate([x])}, None) for x in lines]
    connection.request('PUT', '/elsewhere', b'{"text": ["A dog."]}')
    response = connection.getresponse()
    assert (response.status, response.getheader('Connection')) == (404, 'close')
    assert 'no such path' in json.loads(response.read())['error']
    assert connection.sock is None  # http.client closed it, as told.
    connection.request('POST', '/translate', json.dumps({'text': lines[:1]}))
    response = connection.getresponse()  # A new connection, answered as before.
    assert (response.status, json.loads(response.read())) == (200, replies[0][1])
  finally:
    connection.close()
  lines = server.log.lines(at_least=5)
  assert len(lines) == 5 and not any('timed out' in x for x in lines), lines


def test_clients_that_leave_and_connection_floods(serving_module, translator):
  """A client that disconnects mid-body or while its translation runs, and hundreds of
  connections opened at once (over max_connections: a JSON 503 or dropped): the server keeps
  answering the others, and every request it answered has its line in the access log."""
  server = Server(serving_module, translator, max_connections=64)
  line = val_lines(1, start=80)
  expected = (200, {'translations': translator.translate(line)})
  try:
    with socket.create_connection(('127.0.0.1', server.port)) as client:
      client.sendall(b'POST /translate HTTP/1.0\r\nContent-Length: 500\r\n\r\n{"text": ')
    with socket.create_connection(('127.0.0.1', server.port)) as client:
      body = json.dumps({'text': line * 40}).encode()
      client.sendall(b'POST /translate HTTP/1.0\r\nContent-Length: %d\r\n\r\n' % len(body)
                     + body)
    assert server.request('/translate', {'text': line})[:2] == expected
    # 300 connections at once, each sending nothing: those over 64 get a 503 at once.
    clients = [socket.create_connection(('127.0.0.1', server.port), timeout=30)
               for _ in range(300)]
    try:
      refused = 0
      for client in clients[100:]:
        data = b''.join(iter(lambda client=client: client.recv(1 << 16), b''))
        if data:
          assert 'connections open' in json_error(data, 503)
          refused += 1
      assert refused >= 200 - 10, refused
    finally:
      for client in clients:
        client.close()
    deadline = time.monotonic() + 30
    while server.http.connections['idle'] + server.http.connections['busy'] > 0:
      assert time.monotonic() < deadline, server.http.connections
      time.sleep(0.05)
    assert server.request('/translate', {'text': line})[:2] == expected
    # 150 requests at once, under the limit: every one answered, the same translation.
    server.http.limits.max_connections = 512
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        server.request('/translate', {'text': line})[:2])) for _ in range(150)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join(300)
    assert results == [expected] * 150
    deadline = time.monotonic() + 30
    while server.http.connections['busy'] and time.monotonic() < deadline:
      time.sleep(0.01)  # The last handlers write their lines.
    log = server.log.lines()
    answered = [x for x in log if re.fullmatch(
        r'127\.0\.0\.1 "POST /translate HTTP/1\.[01]" 200 sentences=1 ms=\d+\.\d', x)]
    assert len(answered) == 152, log[-5:]
    assert sum(' 503 ' in x for x in log) >= 190
  finally:
    server.close()


def test_health_page_and_access_log(server):
  status, health, _ = server.request('/health')
  assert status == 200 and health['status'] == 'ok' and health['details'] is True
  status, page, headers = server.request('/')
  assert status == 200 and headers['Content-Type'].startswith('text/html')
  assert b'<script>' in page and b'http://' not in page and b'https://' not in page
  server.request('/translate', {'text': ['A dog.', 'A cat.']})
  # Each line is written once its answer is sent: the lines of requests sent one after the
  # other may come in either order.
  lines = server.log.lines(at_least=3)
  assert len(lines) == 3
  for pattern in (r'"GET /health HTTP/1\.1" 200 sentences=0 ms=\d+\.\d',
                  r'"GET / HTTP/1\.1" 200 sentences=0 ms=\d+\.\d',
                  r'"POST /translate HTTP/1\.1" 200 sentences=2 ms=\d+\.\d'):
    assert sum(bool(re.fullmatch(r'127\.0\.0\.1 ' + pattern, line)) for line in lines) == 1, lines


def stderr_line(process: subprocess.Popen, start: str) -> str:
  """The next line `process` writes to stderr that starts with `start` (others skipped)."""
  for line in iter(process.stderr.readline, b''):
    if line.decode().startswith(start):
      return line.decode()
  raise AssertionError(f'the process ended without a line starting {start!r}')


def test_sigterm_answers_every_request_begun(exported_jax, translator):
  """serving.py --http as a user runs it: SIGTERM while requests are in flight (one of them
  still sending its body) stops new connections, answers every request begun in full, then
  the process exits 0."""
  process = subprocess.Popen([sys.executable, '-c', isolated(), exported_jax, '--model',
                              exported_jax, '--http', '0'], stderr=subprocess.PIPE)
  try:
    port = int(re.search(r'http://127\.0\.0\.1:(\d+)/', stderr_line(process, 'Serving'))[1])
    lines = val_lines(24, start=100)
    expected = translator.translate(lines)
    body = json.dumps({'text': lines}).encode()
    slow = socket.create_connection(('127.0.0.1', port), timeout=300)
    slow.sendall(b'POST /translate HTTP/1.0\r\nContent-Length: %d\r\n\r\n' % len(body)
                 + body[:20])
    results = []

    def client(i):
      connection = http.client.HTTPConnection('127.0.0.1', port, timeout=300)
      connection.request('POST', '/translate', json.dumps({'text': [lines[i]]}))
      response = connection.getresponse()
      results.append((i, response.status, json.loads(response.read())))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for thread in threads:
      thread.start()
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    stderr_line(process, 'SIGTERM: draining')
    with pytest.raises(ConnectionRefusedError):
      socket.create_connection(('127.0.0.1', port), timeout=10)
    slow.sendall(body[20:])
    reply = b''.join(iter(lambda: slow.recv(1 << 16), b''))
    head, _, answer = reply.partition(b'\r\n\r\n')
    assert re.match(rb'HTTP/1\.[01] 200 ', head), reply[:300]
    assert json.loads(answer) == {'translations': expected}
    for thread in threads:
      thread.join(300)
    assert sorted(results) == [(i, 200, {'translations': [expected[i]]}) for i in range(16)]
    assert process.wait(timeout=120) == 0
    stderr = process.stderr.read().decode()
    assert 'Stopped: every request begun was answered' in stderr, stderr
  finally:
    process.kill()
    process.wait()
