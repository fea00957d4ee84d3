"""export.py --format jax and serving.py: the exported translator translates as decode.py does,
with only jax, numpy, sentencepiece and flatbuffers importable."""

import codecs
import http.client
import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from parity import assert_varied

from nmt import runs, sharding, text_io
from nmt import translator as translator_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run serving.py with everything but jax, numpy, sentencepiece, flatbuffers and the standard
# library unimportable: Flax, TensorFlow, and every module of this project.
BLOCKED = ('flax', 'tensorflow', 'tensorflow_datasets', 'optax', 'orbax', 'ml_collections',
           'absl', 'sacrebleu', 'model', 'nmt', 'translation', 'input_pipeline', 'checkpoints',
           'sharding', 'console', 'decode', 'train', 'export', 'configs')


def isolated(blocked: tuple[str, ...] = BLOCKED) -> str:
  """A `python -c` program: runs FOLDER/serving.py (argv[1]) with `blocked` unimportable."""
  return f"""
import runpy, sys
class Block:
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in {blocked!r}:
      raise ImportError('serving.py may not import ' + name)
sys.meta_path.insert(0, Block())
sys.path = [p for p in sys.path if p not in ('', {REPO!r})]
folder = sys.argv.pop(1)
sys.path.insert(0, folder)
runpy.run_path(folder + '/serving.py', run_name='__main__')
"""


ISOLATED = isolated()


@pytest.fixture(scope='module')
def exported(exported_jax):
  return exported_jax


def sources():
  """Varied lengths (several buckets), an empty line, one line longer than any bucket."""
  lines = text_io.read_lines(os.path.join(os.environ['MULTI30K_DIR'], 'val.en'))
  picked = [lines[i] for i in (0, 3, 7, 11)]
  return picked[:2] + [''] + picked[2:] + [' '.join(lines[:12]), 'Hi.']


def test_exported_translator_equals_decode(trained_run, exported, tmp_path):
  config, tokenizer, model = runs.load_run(trained_run)
  translator = translator_lib.Translator(model, tokenizer, config.decode, sharding.make_mesh())
  params, _ = runs.load_params(trained_run, translator.mesh)
  lines = sources()
  expected = translator(params, lines)
  assert expected[2] == ''
  assert_varied(expected)

  sys.path.insert(0, exported)
  try:
    import serving
    assert serving.ExportedTranslator(exported).translate(lines) == expected
  finally:
    sys.path.remove(exported)

  (tmp_path / 'src.txt').write_text(''.join(line + '\n' for line in lines), encoding='utf-8')
  result = subprocess.run([sys.executable, '-c', ISOLATED, exported, '--model', exported,
                           '--input', str(tmp_path / 'src.txt')], capture_output=True,
                          timeout=600, cwd=str(tmp_path))
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  assert result.stdout.decode().split('\n')[:-1] == expected
  assert 'cut to 128' in result.stderr.decode()


def test_exported_continuous_batching_equals_decode(trained_run, exported, monkeypatch):
  """More sentences than the slots: a CPU export decodes them with continuous batching (one
  program per bucket, a queue of fixed size), with decode.py's translations."""
  with open(os.path.join(exported, 'translator.json'), encoding='utf-8') as f:
    continuous = json.load(f)['continuous']
  assert continuous['slots'] == translator_lib.CONTINUOUS_SLOTS
  lines = text_io.read_lines(os.path.join(os.environ['MULTI30K_DIR'], 'val.en'))
  lines = lines[:translator_lib.CONTINUOUS_SLOTS + 20] + ['']
  config, tokenizer, model = runs.load_run(trained_run)
  translator = translator_lib.Translator(model, tokenizer, config.decode, sharding.make_mesh())
  params, _ = runs.load_params(trained_run, translator.mesh)
  expected = translator(params, lines)  # The batch search over the test's 8 devices.
  assert_varied(expected)

  sys.path.insert(0, exported)
  try:
    import serving
    exported_translator = serving.ExportedTranslator(exported)
    queues = []
    original = exported_translator._continuous
    monkeypatch.setattr(exported_translator, '_continuous',
                        lambda ids, members, outputs: (queues.append(len(members)),
                                                       original(ids, members, outputs)))
    assert exported_translator.translate(lines) == expected
    assert queues == [len(lines) - 1]  # The empty line is not decoded.
  finally:
    sys.path.remove(exported)


def serve(model, *args, blocked=BLOCKED, **kwargs) -> subprocess.CompletedProcess:
  """serving.py of the folder `model` run with `args` (after --model) and `blocked`
  unimportable."""
  return subprocess.run([sys.executable, '-c', isolated(blocked), model, '--model', model,
                         *args], capture_output=True, timeout=600, **kwargs)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
  """The process failed with a one-line `error: ...` (holding `fragments`), no traceback."""
  stderr = result.stderr.decode()
  assert result.returncode != 0 and 'Traceback' not in stderr, stderr
  last = stderr.strip().splitlines()[-1]
  assert last.startswith('error: ') and all(f in last for f in fragments), stderr


def test_serving_without_flatbuffers_says_to_install_it(exported, tmp_path):
  (tmp_path / 'src.txt').write_text('A dog.\n', encoding='utf-8')
  result = serve(exported, '--input', str(tmp_path / 'src.txt'),
                 blocked=BLOCKED + ('flatbuffers',))
  assert_one_line_error(result, 'pip install flatbuffers')
  assert result.stdout == b''


@pytest.fixture(scope='module')
def serving_module(exported):
  """The exported folder's serving.py, imported."""
  sys.path.insert(0, exported)
  try:
    import serving
    return serving
  finally:
    sys.path.remove(exported)


@pytest.fixture(scope='module')
def translator(serving_module, exported):
  """The exported folder's ExportedTranslator, loaded once."""
  return serving_module.ExportedTranslator(exported)


def test_serving_splits_lines_at_newlines_only(exported, translator, tmp_path):
  """A lone '\r' stays inside its line (text-mode reading split there and shifted every later
  output line); '\r\n' ends a line, a UTF-8 BOM at the start is dropped, a last line without
  '\n' counts. From a file and from a redirected stdin."""
  data = codecs.BOM_UTF8 + b'A dog\rruns.\r\nTwo men sit.\n\nA girl in red.'
  (tmp_path / 'src.txt').write_bytes(data)
  expected = translator.translate(['A dog\rruns.', 'Two men sit.', '', 'A girl in red.'])
  assert expected[1:] == translator.translate(['Two men sit.', '', 'A girl in red.'])
  result = serve(exported, '--input', str(tmp_path / 'src.txt'))
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  assert result.stdout.decode().split('\n') == expected + ['']
  with open(tmp_path / 'src.txt', 'rb') as stdin:
    result = serve(exported, stdin=stdin)
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  assert result.stdout.decode().split('\n') == expected + ['']


def test_serving_names_the_line_of_invalid_utf8(exported, tmp_path):
  (tmp_path / 'src.txt').write_bytes(b'A dog runs.\nCaf\xe9 au lait.\n')
  assert_one_line_error(serve(exported, '--input', str(tmp_path / 'src.txt')),
                        f'{tmp_path / "src.txt"}:2: invalid UTF-8')
  with open(tmp_path / 'src.txt', 'rb') as stdin:
    assert_one_line_error(serve(exported, stdin=stdin), 'stdin:2: invalid UTF-8')


def test_stream_lines_takes_the_lines_already_arrived(serving_module):
  """A pipe's lines come in chunks: the first line waited for, then every complete line already
  readable; split at '\n' only, BOM dropped, invalid UTF-8 named by its line. The exported
  folder's copy of text_io.py, the one serving.py reads with."""
  assert serving_module.text_io.__file__.startswith(os.path.dirname(serving_module.__file__))
  read_fd, write_fd = os.pipe()
  try:
    stream = serving_module.text_io.stream_lines(read_fd)
    os.write(write_fd, codecs.BOM_UTF8 + b'One.\nTwo\rtwo.\r\nThree.\nFou')
    assert next(stream) == ['One.', 'Two\rtwo.', 'Three.']
    os.write(write_fd, b'r.\n')
    assert next(stream) == ['Four.']
    os.write(write_fd, b'\xef\xbb\xbfFive.\nCaf\xe9.\n')  # A BOM only starts the input.
    with pytest.raises(ValueError, match=r'^stdin:6: invalid UTF-8'):
      next(stream)
  finally:
    os.close(write_fd)
    os.close(read_fd)
  read_fd, write_fd = os.pipe()
  os.write(write_fd, b'Last line without a newline')
  os.close(write_fd)
  assert list(serving_module.text_io.stream_lines(read_fd)) == [['Last line without a newline']]
  os.close(read_fd)


def read_output_lines(fd: int, count: int, timeout: float = 300) -> list[str]:
  """The next `count` lines a process writes to the pipe `fd`, waiting at most `timeout`."""
  data, deadline = b'', time.monotonic() + timeout
  while data.count(b'\n') < count:
    ready = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]
    assert ready, f'no output after {timeout} s; got {data!r}'
    chunk = os.read(fd, 1 << 16)
    assert chunk, f'the output ended; got {data!r}'
    data += chunk
  assert data.count(b'\n') == count, data
  return data.decode().split('\n')[:-1]


def test_serving_answers_each_line_of_a_pipe_at_once(exported, translator):
  """Interactive use through a real pipe: each line's translation comes before the next line
  is written, and several lines written at once all come back (stream_lines, tested above,
  takes them as one chunk); invalid UTF-8 ends the run with a one-line error naming its line,
  after the lines before it."""
  lines = sources()[:4]
  expected = translator.translate(lines)
  process = subprocess.Popen([sys.executable, '-c', ISOLATED, exported, '--model', exported],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
  try:
    for line, translation in zip(lines[:2], expected[:2]):
      process.stdin.write(line.encode() + b'\n')
      process.stdin.flush()
      assert read_output_lines(process.stdout.fileno(), 1) == [translation]
    process.stdin.write(''.join(line + '\n' for line in lines[2:]).encode())
    process.stdin.flush()
    assert read_output_lines(process.stdout.fileno(), 2) == expected[2:]
    process.stdin.write(b'Caf\xe9.\n')
    process.stdin.close()
    assert process.wait(timeout=300) != 0
    stderr = process.stderr.read().decode()
  finally:
    process.kill()
    process.wait()
  assert 'Traceback' not in stderr, stderr
  assert stderr.strip().splitlines()[-1].startswith('error: stdin:5: invalid UTF-8'), stderr


def model_variant(exported, folder, drop: tuple[str, ...] = (), **manifest) -> str:
  """`folder`: the exported files linked, but for `drop`; translator.json updated by
  `manifest`."""
  os.makedirs(folder)
  for name in os.listdir(exported):
    if name not in drop and name != 'translator.json' and os.path.isfile(f'{exported}/{name}'):
      os.symlink(os.path.join(exported, name), os.path.join(folder, name))
  with open(os.path.join(exported, 'translator.json'), encoding='utf-8') as f:
    saved = json.load(f)
  with open(os.path.join(folder, 'translator.json'), 'w', encoding='utf-8') as f:
    json.dump({**saved, **manifest}, f)
  return str(folder)


def test_serving_argument_and_model_errors_are_one_line(exported, serving_module, tmp_path):
  """Each a one-line `error: ...` with exit status 1, before anything is translated; the
  command line runs in-process here (its exit message is what the user sees)."""
  source = tmp_path / 'src.txt'
  source.write_text('A dog.\n', encoding='utf-8')
  taken = socket.socket()
  taken.bind(('127.0.0.1', 0))
  taken.listen()
  port = taken.getsockname()[1]
  no_params = model_variant(exported, tmp_path / 'no_params', drop=('params.npz',))
  no_program = model_variant(exported, tmp_path / 'no_program', drop=('translator_16.jax',))
  tpu = model_variant(exported, tmp_path / 'tpu', platform='tpu')
  cases = [
      ([exported, '--input', str(tmp_path / 'missing.txt')], 'missing.txt: no such file'),
      ([exported, '--input', str(tmp_path)], 'a folder, not a file'),
      ([exported, '--input', str(source), '--output', str(tmp_path / 'no' / 'out.txt')],
       f'the folder {tmp_path / "no"} does not exist'),
      ([exported, '--http', '70000'], '--http 70000: a port is a number from 0 to 65535'),
      ([exported, '--http', str(port)], f'cannot serve on 127.0.0.1:{port}: Address already'),
      ([no_params, '--input', str(source)], 'lacks params.npz'),
      ([no_program, '--input', str(source)], 'lacks translator_16.jax'),
      ([tpu, '--input', str(source)], 'was exported for tpu and jax here runs on cpu'),
  ]
  try:
    for args, fragment in cases:
      with pytest.raises(SystemExit) as exit_info:
        serving_module.main(['--model', *args])
      message = exit_info.value.code
      assert isinstance(message, str) and message.startswith('error: '), (args, message)
      assert fragment in message and '\n' not in message, (args, message)
  finally:
    taken.close()
  with pytest.raises(ValueError, match='was exported for tpu'):
    serving_module.ExportedTranslator(tpu)
  assert_one_line_error(serve(tpu, '--input', str(source)), 'exported for tpu', '--platform cpu')


def test_export_errors_are_one_line(tmp_path):
  """A run that is none, and an --output that is a file, a non-empty folder (without
  --overwrite), or a folder holding the run (with it): one line each, nothing removed."""
  (tmp_path / 'run').mkdir()
  (tmp_path / 'file').write_text('x')
  (tmp_path / 'full').mkdir()
  (tmp_path / 'full' / 'model.bin').write_text('x')
  for output, extra, fragment in (
      (tmp_path / 'out', [], ''), (tmp_path / 'file', [], 'is a file'),
      (tmp_path / 'full', [], 'is not empty'), (tmp_path, ['--overwrite'], 'holds the run')):
    result = subprocess.run([sys.executable, 'export.py', '--workdir', str(tmp_path / 'run'),
                             '--format', 'jax', '--output', str(output), *extra], cwd=REPO,
                            capture_output=True, timeout=300)
    stderr = result.stderr.decode()
    assert result.returncode == 1 and 'Traceback' not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith('error: ') and fragment in last, stderr
  assert (tmp_path / 'full' / 'model.bin').exists() and (tmp_path / 'run').is_dir()


def test_http_endpoint_translates_json_lists(serving_module, translator):
  """Translations in the request's order; bad requests get JSON errors and the server keeps
  serving: a slow client holds up no other (and is let go after the read timeout), a huge
  Content-Length gets 413, a lone surrogate 400, a method other than POST 405."""
  lines = sources()[:3]
  server = serving_module.make_http_server(translator, '127.0.0.1', 0)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  url = f'http://127.0.0.1:{server.server_port}'

  def request(path, body=None, method='POST', timeout=120):
    """(status, JSON body, headers) of a request."""
    request = urllib.request.Request(url + path, data=body, method=method)
    try:
      with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
      return error.code, json.loads(error.read()), error.headers

  def post(path, body):
    return request(path, body)[:2]

  def slow_client() -> socket.socket:
    """A connection that announces a 1000-byte body, sends 15 bytes and waits."""
    client = socket.create_connection(('127.0.0.1', server.server_port), timeout=120)
    client.sendall(b'POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n'
                   b'{"text": ["A do')
    return client

  good = json.dumps({'text': lines}).encode()
  expected = (200, {'translations': translator.translate(lines)})
  try:
    assert post('/translate', good) == expected
    assert post('/translate', json.dumps({'text': lines[0]}).encode()) == (
        200, {'translations': translator.translate(lines[:1])})
    for bad in (b'not json', b'{"q": "x"}', b'{"text": [1, 2]}'):
      status, body = post('/translate', bad)
      assert status == 400 and 'expected a JSON body' in body['error']
    assert post('/other', b'{}')[0] == 404
    status, body = post('/translate', b'{"text": ["A dog \\ud800 runs."]}')
    assert status == 400 and 'lone surrogate' in body['error'], body
    for method in ('GET', 'PUT', 'DELETE'):
      status, body, headers = request('/translate', None if method == 'GET' else b'{}', method)
      assert (status, headers['Allow']) == (405, 'POST') and 'POST' in body['error'], body
    connection = http.client.HTTPConnection('127.0.0.1', server.server_port, timeout=120)
    connection.putrequest('POST', '/translate')
    connection.putheader('Content-Length', str(10**12))
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413, response.status
    assert str(serving_module.serving_http.MAX_BODY_BYTES) in json.loads(response.read())['error']
    connection.close()
    stalled = slow_client()
    try:  # Answered well before the server lets the stalled client go.
      assert server.RequestHandlerClass.timeout >= 60
      assert request('/translate', good, timeout=30)[:2] == expected
    finally:
      stalled.close()
    server.RequestHandlerClass.timeout = 1
    stalled = slow_client()
    try:
      reply = b''.join(iter(lambda: stalled.recv(1 << 16), b'')).decode()  # Until it closes.
      assert re.match(r'HTTP/1\.[01] 408 ', reply) and '"error"' in reply, reply
    finally:
      stalled.close()
    assert post('/translate', good) == expected
  finally:
    server.shutdown()
    server.server_close()
