"""Real-text decoding: decode.py, the exported translator and CTranslate2 on the same weights.

    python -m benchmarks.real_text --workdir runs/multi30k --checkpoint averaged \
        --source test_2016_flickr.en --reference test_2016_flickr.de [--rounds 3] \
        [--split test_2016_flickr] [--baseline_repo /path/to/older/checkout] \
        --output results.json

Each engine runs as its own process, one at a time, the engines alternating within each round:
`decode.py` with an empty compilation cache (what a first run pays) and again with the cache
it filled, `serving.py` on an `export.py --format jax` folder, CTranslate2 float32 and int8 on
`export.py --format ctranslate2` folders (2 threads, beam 4, batches of 4,096 tokens). Each
row gives the whole command's wall time and sentences/s, and sacreBLEU / chrF of its output.
`--split` adds decode.py reading that split of the run's dataset through TFDS, as the README
runs it (the split's text must be --source's; TFDS prepares it once into a scratch folder
before the rounds; MULTI30K_DIR as for training). `--baseline_repo` adds decode.py of another
checkout (e.g. an earlier commit), reading --source (or --split). A last row
measures decode.py's Translator in one process: the first call (compiling) and a second call
(steady state).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CTRANSLATE2 = """
import sys, time
start = time.time()
import ctranslate2, sentencepiece as spm
folder, source, output = sys.argv[1:4]
translator = ctranslate2.Translator(folder, device='cpu', inter_threads=1, intra_threads=2)
sp = spm.SentencePieceProcessor(model_file=folder + '/tokenizer.model')
lines = [line.rstrip('\\n') for line in open(source, encoding='utf-8')]
loaded = time.time()
results = translator.translate_batch([sp.encode(x, out_type=str) for x in lines], beam_size=4,
                                     max_batch_size=4096, batch_type='tokens',
                                     length_penalty=0.6, max_decoding_length=256)
with open(output, 'w', encoding='utf-8') as f:
  f.writelines(sp.decode(r.hypotheses[0]) + '\\n' for r in results)
print(f'load {loaded - start:.3f} translate {time.time() - loaded:.3f}', file=sys.stderr)
"""

STEADY = """
import json, sys, time
import input_pipeline
from nmt import sharding, translation
from nmt import runs
from nmt import text_io
from nmt import translator as translator_lib
workdir, checkpoint, source, stopping = sys.argv[1:5]
checkpoint = checkpoint or None
config, tokenizer, model = runs.load_run(workdir)
mesh = sharding.make_mesh()
translator = translator_lib.Translator(model, tokenizer, config.decode, mesh,
                                    stopping=stopping or None)
params, _ = runs.load_params(workdir, mesh, checkpoint)
lines = text_io.read_lines(source)
times = []
for _ in range(2):
  start = time.time()
  translator(params, lines)
  times.append(time.time() - start)
print(json.dumps({'first_call_s': times[0], 'second_call_s': times[1]}))
"""


def score(hypothesis_path: str, reference_path: str) -> dict[str, float]:
  import sacrebleu
  read = lambda p: [line.rstrip('\n') for line in open(p, encoding='utf-8')]
  hypotheses, references = read(hypothesis_path), read(reference_path)
  return {'bleu': sacrebleu.corpus_bleu(hypotheses, [references]).score,
          'chrf': sacrebleu.corpus_chrf(hypotheses, [references]).score}


def timed(command: list[str], env: dict[str, str] | None = None, cwd: str = REPO) -> float:
  start = time.time()
  result = subprocess.run(command, cwd=cwd, env={**os.environ, **(env or {})},
                          capture_output=True, timeout=3600)
  if result.returncode:
    raise RuntimeError(f'{command[:3]} failed: {result.stderr.decode()[-2000:]}')
  return time.time() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--checkpoint', default=None)
  parser.add_argument('--source', required=True)
  parser.add_argument('--reference', required=True)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--baseline_repo', default=None)
  parser.add_argument('--split', default=None,
                      help="also decode.py --split SPLIT of the run's dataset (the README's way)")
  parser.add_argument('--stopping', choices=('exact', 'early'), default=None,
                      help="decode.py's and the in-process Translator's (default: the run's)")
  parser.add_argument('--engines', default=None,
                      help='comma-separated substrings: run only the engines whose names hold one')
  parser.add_argument('--output', default=None)
  args = parser.parse_args()
  python = sys.executable
  scratch = tempfile.mkdtemp(prefix='real_text_')
  checkpoint = ['--checkpoint', args.checkpoint] if args.checkpoint else []
  folders = {}
  for fmt, extra in (('jax', []), ('ctranslate2', []), ('ctranslate2_int8',
                                                        ['--quantization', 'int8'])):
    folders[fmt] = os.path.join(scratch, fmt)
    timed([python, 'export.py', '--workdir', args.workdir, '--format', fmt.split('_')[0],
           '--output', folders[fmt], *checkpoint, *extra])
  count = sum(1 for _ in open(args.source, encoding='utf-8'))
  source = lambda split: ['--split', args.split] if split else ['--input', args.source]
  decode = lambda repo, split=False: [
      python, os.path.join(repo, 'decode.py'), '--workdir', args.workdir, *source(split),
      *checkpoint, *(['--stopping', args.stopping] if args.stopping else [])]
  tfds = {'TFDS_DATA_DIR': os.path.join(scratch, 'tfds')}
  engines = {
      'decode.py, empty compilation cache': lambda out, cache: timed(
          [*decode(REPO), '--output', out],
          {'JAX_COMPILATION_CACHE_DIR': cache + '_cold_' + str(time.time())}),
      'decode.py, compilation cache filled': lambda out, cache: timed(
          [*decode(REPO), '--output', out], {'JAX_COMPILATION_CACHE_DIR': cache}),
      'decode.py --split, compilation cache filled': lambda out, cache: timed(
          [*decode(REPO, True), '--output', out], {'JAX_COMPILATION_CACHE_DIR': cache, **tfds}),
      'serving.py (export.py --format jax)': lambda out, cache: timed(
          [python, os.path.join(folders['jax'], 'serving.py'), '--model', folders['jax'],
           '--input', args.source, '--output', out]),
      'CTranslate2 float32': lambda out, cache: timed(
          [python, '-c', CTRANSLATE2, folders['ctranslate2'], args.source, out]),
      'CTranslate2 int8': lambda out, cache: timed(
          [python, '-c', CTRANSLATE2, folders['ctranslate2_int8'], args.source, out]),
  }
  if not args.split:
    del engines['decode.py --split, compilation cache filled']
  if args.baseline_repo:
    engines['decode.py of --baseline_repo'] = lambda out, cache: timed(
        [*decode(args.baseline_repo, bool(args.split)), '--output', out],
        {'JAX_COMPILATION_CACHE_DIR': '', **tfds}, cwd=args.baseline_repo)
  if args.engines:
    wanted = [w for w in args.engines.split(',') if w]
    engines = {k: v for k, v in engines.items() if any(w in k for w in wanted)}
  cache = os.path.join(scratch, 'compilation_cache')
  timed([*decode(REPO), '--output', os.devnull], {'JAX_COMPILATION_CACHE_DIR': cache})
  if args.split:  # Prepares the split's TFDS files (with TensorFlow), once.
    timed([*decode(REPO, True), '--output', os.devnull], {'JAX_COMPILATION_CACHE_DIR': cache,
                                                          **tfds})
  rows = {name: {'seconds': []} for name in engines}
  for round_index in range(args.rounds):
    for name, run in engines.items():
      out = os.path.join(scratch, f'{len(rows[name]["seconds"])}_{abs(hash(name))}.txt')
      rows[name]['seconds'].append(run(out, cache))
      rows[name].update(score(out, args.reference))
      print(f'round {round_index + 1} | {name}: {rows[name]["seconds"][-1]:.1f} s', flush=True)
  for row in rows.values():
    row['median_s'] = statistics.median(row['seconds'])
    row['sentences_per_s'] = count / row['median_s']
  result = subprocess.run([python, '-c', STEADY, args.workdir, args.checkpoint or '',
                           args.source, args.stopping or ''], cwd=REPO, capture_output=True,
                          timeout=3600)
  steady = json.loads(result.stdout.decode().strip().splitlines()[-1])
  steady['sentences_per_s_steady'] = count / steady['second_call_s']
  report = {'sentences': count, 'engines': rows, 'translator_in_one_process': steady}
  print(json.dumps(report, indent=2))
  if args.output:
    with open(args.output, 'w', encoding='utf-8') as f:
      json.dump(report, f, indent=2)


if __name__ == '__main__':
  main()
