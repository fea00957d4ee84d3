"""Load on `serving.py --http`: throughput, latency and correctness under concurrent clients,
against decode.py's batch throughput on the same sentences and a one-request-at-a-time server.

    python -m benchmarks.serving_load --model EXPORTED --workdir RUN --checkpoint averaged \
        --sentences test_2016_flickr.en --baseline_serving OLD_SERVING_PY \
        [--clients 1,8,32] [--seconds 60] [--rounds 2] [--soak_minutes 10] --output results.json

Steps, one at a time on the same machine:
  1. decode.py on --sentences (its own process, a scratch compilation cache): its translations
     are the reference every response is checked against; its logged sentences/s, and
     decode.py's Translator called 1 + WARM_CALLS times in one process (its fastest warm call:
     the batch throughput the servers are compared with).
  2. The servers (the batched `serving.py` of --model with --warmup, with --no_pool also
     without its slot pool, and --baseline_serving, e.g. the one-at-a-time server from
     `git show 5c73c73:serving.py`), each started on a free port, all running at once (an
     idle one takes no CPU): every (bucket, batch rows) shape the clients can cause is
     compiled first (requests of 1, 2, 4, ... sentences of one bucket). Then --rounds
     rounds, each: decode.py's batch throughput again (but in the first), and per server
     (their order reversed every other round) per client count a warm-up of
     --warmup_seconds and --seconds measured. Each client sends one-sentence requests in a
     loop, the sentences taken in turn from --sentences, on one connection kept open as long
     as the server keeps it (--connections per_request: a connection each). Per level:
     requests/s, sentences/s, latency p50/p95/p99, errors (a failed request or a status
     other than 200) and mismatches (a translation other than decode.py's), and from
     /health the batches and searches the server ran. Each round's ratios use only numbers
     measured in that round (a machine's speed drifts over minutes); the JSON's ratios are
     their medians. After the clients, the pool's ceiling (--ceiling_seconds): the slot pool
     in one process with as many slots as the most clients, then 128, kept full by one thread
     (an ended sentence replaced at once; no clients, no HTTP): what the pool's own search
     gives at that many sentences in flight.
  3. A soak of the batched server: --soak_clients clients for --soak_minutes, its resident
     memory (VmRSS) sampled every --sample_seconds; growth is the median of the last minute
     over the median of the second minute (the first is warm-up).
  4. SIGTERM under load: 32 clients, SIGTERM after --sigterm_after seconds; every request must
     get its whole answer or be refused before the server read it (refused connection, or a
     reset with no byte of answer), and the server's log must show no dropped request.
The JSON has the machine, every number above, and the ratios the issue asks for.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# decode.py's Translator on the sentences: a first call (compiles), then WARM_CALLS calls whose
# fastest gives the batch throughput (a pass takes seconds: one pass moves with the machine).
WARM_CALLS = 3
STEADY = """
import json, sys, time
from nmt import runs, sharding, text_io
from nmt import translator as translator_lib
workdir, checkpoint, source, output, warm_calls = sys.argv[1:6]
config, tokenizer, model = runs.load_run(workdir)
mesh = sharding.make_mesh()
translator = translator_lib.Translator(model, tokenizer, config.decode, mesh)
params, _ = runs.load_params(workdir, mesh, checkpoint or None)
lines = text_io.read_lines(source)
times = []
for _ in range(1 + int(warm_calls)):
  start = time.time()
  translations = translator(params, lines)
  times.append(time.time() - start)
with open(output, 'w', encoding='utf-8') as f:
  json.dump({'first_call_s': times[0], 'warm_calls_s': times[1:],
             'translations': translations}, f)
"""

# The slot pool's ceiling: `slots` slots kept full by one thread, each ended sentence replaced
# by the next at once (no clients, no HTTP, no wait between an answer and the next request).
POOL_CEILING = """
import json, sys, time
import jax
import serving_batcher, serving_translator
folder, source, slots, seconds, steps = sys.argv[1:6]
slots, seconds, steps = int(slots), float(seconds), int(steps)
translator = serving_translator.ExportedTranslator(folder)
ids = translator.encode([line.rstrip('\\n') for line in open(source, encoding='utf-8')])
ids = [x for x in ids if len(x) > 1 and len(x) <= translator.manifest['pool']['width']]
pool = serving_batcher.SlotPool(translator, steps)
pool.warm_up()
admitted = 0
def fill():
  global admitted
  count = slots - pool.running
  if count:
    pool.admit([(admitted + i, ids[(admitted + i) % len(ids)]) for i in range(count)])
    jax.block_until_ready(pool.state)
    admitted += count
fill()
ended = calls = 0
admitting = 0.0
start = time.perf_counter()
while time.perf_counter() - start < seconds:
  ended += len(pool.step())
  calls += 1
  mark = time.perf_counter()
  fill()
  admitting += time.perf_counter() - mark
elapsed = time.perf_counter() - start
print(json.dumps({'slots': slots, 'steps_per_call': steps, 'sentences_per_s': ended / elapsed,
                  'ms_per_call': 1000 * elapsed / calls, 'admission_ms_per_call':
                  1000 * admitting / calls, 'slot_steps_per_sentence':
                  slots * steps * calls / max(ended, 1)}))
"""

# The buckets a sentence of n tokens falls in, as serving.py's ExportedTranslator chooses.
TOKENS = """
import json, sys
import sentencepiece as spm
folder, source = sys.argv[1:3]
sp = spm.SentencePieceProcessor(model_file=folder + '/tokenizer.model')
lines = [line.rstrip('\\n') for line in open(source, encoding='utf-8')]
print(json.dumps([len(x) for x in sp.encode(lines, out_type=int, add_eos=True)]))
"""


def machine() -> dict[str, Any]:
  cpu, avx512 = 'unknown', False
  with open('/proc/cpuinfo', encoding='utf-8') as f:
    for line in f:
      if line.startswith('model name') and cpu == 'unknown':
        cpu = line.split(':', 1)[1].strip()
      if line.startswith('flags') and ' avx512f' in line:
        avx512 = True
  return {'cpu': cpu, 'avx512f': avx512, 'cores': len(os.sched_getaffinity(0)),
          'load_average_at_start': os.getloadavg()}


def percentile(values: list[float], q: float) -> float | None:
  if not values:
    return None
  ordered = sorted(values)
  return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def reference_translations(args: argparse.Namespace, scratch: str) -> dict[str, Any]:
  """decode.py's translations and throughput on args.sentences (see the module docstring)."""
  env = {**os.environ, 'JAX_COMPILATION_CACHE_DIR': os.path.join(scratch, 'decode_cache')}
  checkpoint = ['--checkpoint', args.checkpoint] if args.checkpoint else []
  output = os.path.join(scratch, 'decode.txt')
  rates = []
  for _ in range(2):  # The second run loads the programs the first compiled.
    result = subprocess.run(
        [sys.executable, 'decode.py', '--workdir', args.workdir, '--input', args.sentences,
         '--output', output, *checkpoint], cwd=REPO, env=env, capture_output=True,
        timeout=7200)
    if result.returncode:
      raise RuntimeError(f'decode.py failed: {result.stderr.decode()[-2000:]}')
    logged = re.findall(r'Translated (\d+) sentences in ([\d.]+) s \(([\d.]+) sentences/s\)',
                        result.stderr.decode())
    rates.append(float(logged[-1][2]))
  with open(output, encoding='utf-8') as f:
    translations = f.read().split('\n')[:-1]
  steady = batch_throughput(args, scratch)
  equal = steady.pop('translations') == translations
  return {'sentences': len(translations), 'translations': translations,
          'decode_py_logged_sentences_per_s': rates, **steady,
          'translator_equals_decode_py': equal}


def batch_throughput(args: argparse.Namespace, scratch: str) -> dict[str, Any]:
  """decode.py's Translator called 1 + WARM_CALLS times in one process on args.sentences: the
  fastest warm call's sentences/s is the batch throughput the servers are compared with."""
  env = {**os.environ, 'JAX_COMPILATION_CACHE_DIR': os.path.join(scratch, 'decode_cache')}
  steady = os.path.join(scratch, 'steady.json')
  result = subprocess.run([sys.executable, '-c', STEADY, args.workdir, args.checkpoint or '',
                           args.sentences, steady, str(WARM_CALLS)], cwd=REPO, env=env,
                          capture_output=True, timeout=7200)
  if result.returncode:
    raise RuntimeError(f'the in-process Translator failed: {result.stderr.decode()[-2000:]}')
  with open(steady, encoding='utf-8') as f:
    steady = json.load(f)
  return {'translator_first_call_s': steady['first_call_s'],
          'translator_warm_calls_s': steady['warm_calls_s'],
          'batch_sentences_per_s': len(steady['translations']) / min(steady['warm_calls_s']),
          'translations': steady['translations']}


def pool_ceiling(args: argparse.Namespace, slots: int) -> dict[str, Any]:
  """The slot pool of --model with `slots` slots kept full for --ceiling_seconds (POOL_CEILING):
  what the pool gives at that many sentences in flight before any client or HTTP cost."""
  result = subprocess.run([sys.executable, '-c', POOL_CEILING, os.path.abspath(args.model),
                           os.path.abspath(args.sentences), str(slots), str(args.ceiling_seconds),
                           '2'], cwd=args.model, capture_output=True, timeout=3600)
  if result.returncode:
    raise RuntimeError(f'the pool ceiling failed: {result.stderr.decode()[-2000:]}')
  return json.loads(result.stdout.decode().strip().splitlines()[-1])


class Server:
  """A serving.py process on a free port, its stderr (the access log) in a file."""

  def __init__(self, serving_py: str, model: str, log_path: str, extra: list[str] = ()):
    self.log_path = log_path
    self.log = open(log_path, 'wb')
    self.process = subprocess.Popen(
        [sys.executable, serving_py, '--model', model, '--http', '0', *extra],
        stderr=self.log, cwd=os.path.dirname(os.path.abspath(serving_py)))
    deadline = time.monotonic() + 3600  # --warmup compiles the slot pool first.
    while True:
      with open(log_path, encoding='utf-8', errors='replace') as f:
        found = re.search(r'Serving http://[\d.]+:(\d+)/', f.read())
      if found:
        self.port = int(found[1])
        break
      if self.process.poll() is not None or time.monotonic() > deadline:
        raise RuntimeError(f'{serving_py} did not start: {open(log_path).read()[-2000:]}')
      time.sleep(0.2)

  def connect(self, timeout: float = 600) -> http.client.HTTPConnection:
    return http.client.HTTPConnection('127.0.0.1', self.port, timeout=timeout)

  def post(self, texts: list[str], connection: http.client.HTTPConnection | None = None
           ) -> tuple[int, Any]:
    """(status, JSON body) of a POST /translate: on `connection`, kept open for the next
    request if the server keeps it (HTTP/1.1), or on a connection of its own."""
    own = connection is None
    connection = connection or self.connect()
    try:
      connection.request('POST', '/translate', json.dumps({'text': texts}),
                         {'Content-Type': 'application/json'})
      response = connection.getresponse()
      return response.status, json.loads(response.read())
    except BaseException:
      connection.close()  # Its next request connects again.
      raise
    finally:
      if own:
        connection.close()

  def health(self) -> dict[str, Any] | None:
    """The batched server's /health (None for a server without it)."""
    connection = http.client.HTTPConnection('127.0.0.1', self.port, timeout=60)
    try:
      connection.request('GET', '/health')
      response = connection.getresponse()
      body = response.read()
      return json.loads(body) if response.status == 200 else None
    except (OSError, ValueError):
      return None
    finally:
      connection.close()

  def rss_mb(self) -> float:
    with open(f'/proc/{self.process.pid}/status', encoding='utf-8') as f:
      kb = next(int(line.split()[1]) for line in f if line.startswith('VmRSS:'))
    return kb / 1024

  def stop(self) -> None:
    if self.process.poll() is None:
      self.process.send_signal(signal.SIGTERM)
      try:
        self.process.wait(timeout=120)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
    self.log.close()


def compile_shapes(server: Server, sentences: list[str], lengths: list[int],
                   buckets: list[int], batch_tokens: int, max_rows: int) -> float:
  """Requests of 1, 2, 4, ... max_rows sentences of each bucket the sentences fall in (within
  batch_tokens), so that the server compiles its shapes before the clock runs; seconds."""
  start = time.monotonic()
  by_bucket: dict[int, list[str]] = {}
  for text, n in zip(sentences, lengths):
    by_bucket.setdefault(next(b for b in buckets if b >= n), []).append(text)
  for bucket, texts in sorted(by_bucket.items()):
    rows = 1
    while rows <= max_rows and rows * bucket <= batch_tokens:
      status, body = server.post([texts[i % len(texts)] for i in range(rows)])
      if status != 200:
        raise RuntimeError(f'compiling: {status} {body}')
      rows *= 2
  return time.monotonic() - start


def load(server: Server, sentences: list[str], expected: list[str], clients: int,
         seconds: float, start_index: int = 0, on_sample=None,
         sample_seconds: float = 10.0, persistent: bool = True) -> dict[str, Any]:
  """`clients` threads sending one-sentence requests for `seconds`: the level's numbers.
  `persistent`: each client keeps one connection open as long as the server does (as an
  HTTP/1.1 client does), else it connects anew for each request."""
  latencies: list[float] = []
  errors, mismatches = [], 0
  lock = threading.Lock()
  counter = [start_index]
  before = server.health()
  deadline = time.monotonic() + seconds

  def client():
    nonlocal mismatches
    connection = server.connect() if persistent else None
    while time.monotonic() < deadline:
      with lock:
        index = counter[0] % len(sentences)
        counter[0] += 1
      sent = time.monotonic()
      try:
        status, body = server.post([sentences[index]], connection)
      except Exception as error:  # Counted, and the client goes on.
        with lock:
          errors.append(f'{type(error).__name__}: {error}')
        continue
      elapsed = time.monotonic() - sent
      with lock:
        if status != 200:
          errors.append(f'{status}: {body}')
        elif body['translations'] != [expected[index]]:
          mismatches += 1
        else:
          latencies.append(elapsed)
    if connection is not None:
      connection.close()

  threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
  started = time.monotonic()
  for thread in threads:
    thread.start()
  if on_sample is not None:
    while time.monotonic() < deadline:
      on_sample(time.monotonic() - started)
      time.sleep(min(sample_seconds, max(0.0, deadline - time.monotonic())))
  for thread in threads:
    thread.join()
  wall = time.monotonic() - started
  after = server.health()
  requests = len(latencies) + len(errors) + mismatches
  result = {
      'clients': clients, 'seconds': wall, 'requests': requests,
      'requests_per_s': requests / wall, 'sentences_per_s': len(latencies) / wall,
      'latency_ms': {f'p{q}': 1000 * percentile(latencies, q) if latencies else None
                     for q in (50, 95, 99)},
      'latency_ms_max': 1000 * max(latencies) if latencies else None,
      'errors': len(errors), 'error_examples': errors[:5], 'mismatches': mismatches}
  if before and after:
    batches = after['batches'] - before['batches']
    result.update(batches=batches, searches=after['searches'] - before['searches'],
                  sentences_per_batch=(after['sentences'] - before['sentences']) / max(1,
                                                                                     batches))
    if after.get('pool'):
      result['pool_at_end'] = after['pool']
  return result


def sigterm_under_load(server: Server, sentences: list[str], expected: list[str], clients: int,
                       after_seconds: float) -> dict[str, Any]:
  """Clients until SIGTERM and after it: every request answered in full, or refused."""
  outcomes = {'answered': 0, 'refused': 0, 'reset_before_answer': 0, 'wrong': 0, 'broken': 0}
  examples: list[str] = []
  lock = threading.Lock()
  stop_at = time.monotonic() + after_seconds + 10

  def client(offset):
    index = offset
    while time.monotonic() < stop_at:
      index = (index + clients) % len(sentences)
      try:
        status, body = server.post([sentences[index]])
        kind = 'answered' if status == 200 and body['translations'] == [expected[index]] else (
            'wrong')
      except ConnectionRefusedError:
        kind = 'refused'
        time.sleep(0.05)
      except (ConnectionResetError, http.client.RemoteDisconnected) as error:
        # No byte of an answer: the connection was in the listen queue, never read.
        kind = 'reset_before_answer'
        detail = f'{type(error).__name__}: {error}'
      except Exception as error:
        kind, detail = 'broken', f'{type(error).__name__}: {error}'
      with lock:
        outcomes[kind] += 1
        if kind in ('wrong', 'broken', 'reset_before_answer') and len(examples) < 5:
          examples.append(detail if kind != 'wrong' else f'{status}')

  threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
  for thread in threads:
    thread.start()
  time.sleep(after_seconds)
  in_flight = server.health()
  server.process.send_signal(signal.SIGTERM)
  signalled = time.monotonic()
  code = server.process.wait(timeout=600)
  exited = time.monotonic() - signalled
  for thread in threads:
    thread.join()
  server.log.close()
  with open(server.log_path, encoding='utf-8', errors='replace') as f:
    log = f.read()
  return {'clients': clients, 'outcomes': outcomes, 'examples': examples,
          'exit_code': code, 'seconds_from_sigterm_to_exit': exited,
          'connections_at_sigterm': in_flight and in_flight['connections'],
          'log_dropped_requests': log.count(' dropped '),
          'log_errors': len(re.findall(r'^\S+ error: ', log, re.M)),
          'log_says_every_request_answered': 'Stopped: every request begun was answered' in log}


def ratios(levels: dict[str, dict[str, Any]], batch: float, top: str) -> dict[str, float]:
  """One round's ratios at `top` clients: the batched server against decode.py's batch
  throughput and against the one-at-a-time server."""
  batched = levels['batched'][top]['sentences_per_s']
  result = {f'batched_{top}_clients_vs_decode_batch': batched / batch}
  if 'one_at_a_time' in levels:
    result[f'batched_vs_one_at_a_time_{top}_clients'] = (
        batched / levels['one_at_a_time'][top]['sentences_per_s'])
  return result


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', required=True, help='a folder of export.py --format jax')
  parser.add_argument('--workdir', required=True, help='the run --model was exported from')
  parser.add_argument('--checkpoint', default=None, help="the run's checkpoint exported")
  parser.add_argument('--sentences', required=True, help='one sentence per line')
  parser.add_argument('--baseline_serving', default=None,
                      help='a serving.py to compare with (e.g. the one-at-a-time server)')
  parser.add_argument('--no_pool', action='store_true',
                      help='also measure the batched server without its slot pool (--no_pool)')
  parser.add_argument('--clients', default='1,8,32')
  parser.add_argument('--connections', choices=('persistent', 'per_request'),
                      default='persistent',
                      help='each client keeps its connection while the server does (as '
                           'HTTP/1.1 clients do), or connects anew for each request')
  parser.add_argument('--seconds', type=float, default=60)
  parser.add_argument('--rounds', type=int, default=2,
                      help="rounds of decode.py's batch throughput and every server's levels")
  parser.add_argument('--warmup_seconds', type=float, default=10)
  parser.add_argument('--ceiling_seconds', type=float, default=15,
                      help="each round: the slot pool kept full, with as many slots as the "
                      "most clients and with 128, this long each (0: not measured)")
  parser.add_argument('--soak_minutes', type=float, default=10)
  parser.add_argument('--soak_clients', type=int, default=8)
  parser.add_argument('--sample_seconds', type=float, default=10)
  parser.add_argument('--sigterm_after', type=float, default=10)
  parser.add_argument('--output', default=None)
  args = parser.parse_args(argv)
  scratch = tempfile.mkdtemp(prefix='serving_load_')
  clients = [int(c) for c in args.clients.split(',')]
  persistent = args.connections == 'persistent'
  with open(args.sentences, encoding='utf-8') as f:
    sentences = f.read().split('\n')[:-1]
  results: dict[str, Any] = {'machine': machine(), 'model': os.path.abspath(args.model),
                             'workdir': args.workdir, 'checkpoint': args.checkpoint,
                             'sentences_file': args.sentences, 'settings': vars(args)}
  print('decode.py ...', file=sys.stderr, flush=True)
  reference = reference_translations(args, scratch)
  expected = reference.pop('translations')
  assert len(expected) == len(sentences), (len(expected), len(sentences))
  results['decode'] = reference
  print(json.dumps(reference), file=sys.stderr, flush=True)
  with open(os.path.join(args.model, 'translator.json'), encoding='utf-8') as f:
    manifest = json.load(f)
  lengths = json.loads(subprocess.run([sys.executable, '-c', TOKENS, args.model,
                                       args.sentences], capture_output=True,
                                      check=True).stdout)
  lengths = [min(n, manifest['buckets'][-1]) for n in lengths]
  batched = os.path.join(args.model, 'serving.py')
  servers = {'batched': (batched, ['--warmup'])}
  if args.no_pool:
    servers['batched_without_pool'] = (batched, ['--no_pool'])
  if args.baseline_serving:
    servers['one_at_a_time'] = (args.baseline_serving, [])
  # Every server runs from the start; each round measures decode.py's batch throughput, then
  # each server at each client count (the servers' order reversed every other round), so that
  # the ratios compare numbers taken minutes apart on a machine whose speed drifts.
  results['servers'] = {}
  running: dict[str, Server] = {}
  try:
    for name, (serving_py, extra) in servers.items():
      started = time.monotonic()
      running[name] = Server(serving_py, args.model, os.path.join(scratch, f'{name}.log'), extra)
      results['servers'][name] = {
          'start_s': time.monotonic() - started, 'compile_shapes_s': compile_shapes(
              running[name], sentences, lengths, manifest['buckets'], manifest['batch_tokens'],
              1 << (max(clients) - 1).bit_length()), 'rounds': []}
    results['rounds'] = []
    for round_index in range(args.rounds):
      batch = (reference['batch_sentences_per_s'] if round_index == 0 else
               batch_throughput(args, scratch)['batch_sentences_per_s'])
      names = list(servers) if round_index % 2 == 0 else list(reversed(servers))
      levels: dict[str, dict[str, Any]] = {}
      for name in names:
        levels[name] = {}
        for count in clients:
          load(running[name], sentences, expected, count, args.warmup_seconds,
               start_index=count, persistent=persistent)
          levels[name][str(count)] = load(running[name], sentences, expected, count,
                                          args.seconds, persistent=persistent)
          print(f'round {round_index + 1}', name, json.dumps(levels[name][str(count)]),
                file=sys.stderr, flush=True)
        results['servers'][name]['rounds'].append(levels[name])
      results['rounds'].append({'decode_batch_sentences_per_s': batch,
                                'ratios': ratios(levels, batch, str(max(clients)))})
      if args.ceiling_seconds > 0:
        ceiling = {str(n): pool_ceiling(args, n) for n in sorted({max(clients), 128})}
        results['rounds'][-1]['pool_ceiling'] = ceiling
        for n, numbers in ceiling.items():
          results['rounds'][-1]['ratios'][f'pool_ceiling_{n}_slots_vs_decode_batch'] = (
              numbers['sentences_per_s'] / batch)
      print(f'round {round_index + 1}', json.dumps(results['rounds'][-1]), file=sys.stderr,
            flush=True)
  finally:
    for server in running.values():
      server.stop()
  if args.soak_minutes > 0:
    server = Server(batched, args.model, os.path.join(scratch, 'soak.log'), ['--warmup'])
    samples = []
    try:
      compile_shapes(server, sentences, lengths, manifest['buckets'], manifest['batch_tokens'],
                     1 << (args.soak_clients - 1).bit_length())
      soak = load(server, sentences, expected, args.soak_clients, 60 * args.soak_minutes,
                  on_sample=lambda t: samples.append((round(t, 1), round(server.rss_mb(), 1))),
                  sample_seconds=args.sample_seconds, persistent=persistent)
    finally:
      server.stop()
    second_minute = [rss for t, rss in samples if 60 <= t < 120]
    last_minute = [rss for t, rss in samples if t >= samples[-1][0] - 60]
    soak.update(rss_mb_samples=samples,
                rss_growth_after_warmup=(statistics.median(last_minute) /
                                         statistics.median(second_minute) - 1)
                if second_minute and last_minute else None)
    results['soak'] = soak
    print('soak', json.dumps({k: v for k, v in soak.items() if k != 'rss_mb_samples'}),
          file=sys.stderr, flush=True)
  if args.sigterm_after > 0:
    server = Server(batched, args.model, os.path.join(scratch, 'sigterm.log'), ['--warmup'])
    try:
      compile_shapes(server, sentences, lengths, manifest['buckets'], manifest['batch_tokens'],
                     32)
      results['sigterm'] = sigterm_under_load(server, sentences, expected, 32,
                                              args.sigterm_after)
    finally:
      server.stop()
    print('sigterm', json.dumps(results['sigterm']), file=sys.stderr, flush=True)
  # Each ratio's median over the rounds (each round's ratio of numbers measured in it).
  results['ratios'] = {name: statistics.median(r['ratios'][name] for r in results['rounds'])
                       for name in results['rounds'][0]['ratios']}
  text = json.dumps(results, indent=2)
  if args.output:
    with open(args.output, 'w', encoding='utf-8') as f:
      f.write(text + '\n')
  print(text)


if __name__ == '__main__':
  main()
