"""Throughput, time to the first batch (cold and resumed) and memory of the training pipeline.

  MULTI30K_DIR=../shared/data/multi30k python -m benchmarks.input_pipeline \
      [--workdir DIR] [--json out.json] [--batches 300] [--baseline CHECKOUT]
  MULTI30K_DIR=../shared/data/multi30k python -m benchmarks.input_pipeline \
      --synthetic_pairs 4500000 --processes 1,2 --workdir DIR [--json out.json]

Without --synthetic_pairs: Multi30k train with configs/multi30k.py's data settings. With it: N
aligned pairs made from Multi30k lines (1-3 lines joined per sentence, so lengths look like
WMT's) in DIR/synthetic_N/train.{en,de}, read through the 'folder:' source with
configs/wmt14_base.py's data settings (max_length 128, batch 192, 64 shards) and an 8k
vocabulary. TFDS preparation and the tokenizer are made once in DIR (reused by later runs:
`prepare_seconds` and `prepare_peak_rss_mb` are those of the run that made them). Then for
each count P of --processes, P worker processes (process_index 0..P-1 of P) run one after
another, each a fresh interpreter with the machine to itself, as hosts would, and each
reports:

  * first_batch_seconds (making the iterator, up to its first batch) and
    process_to_first_batch_seconds (from the interpreter's start, imports included): a cold
    start, with the data prepared and the tokenizer trained;
  * batches_per_second, target_tokens_per_second (non-padding target tokens) over --batches
    batches after --warmup, and target_tokens_per_cpu_second (this process's CPU time, which
    other jobs on the machine change less than the wall time); packing_efficiency;
  * resume: a second fresh process continues from the state saved after those batches:
    resume_seconds, resume_process_to_first_batch_seconds, and whether its first batch equals
    the one the first process got next (resume_matches);
  * peak_rss_mb, resume_peak_rss_mb: each process's peak resident memory.

--baseline CHECKOUT: also runs that checkout's own benchmark (e.g. the pipeline of 81f04fe:
`git worktree add ../old_pipeline 81f04fe`) with the same arguments and workdir, before this
one's measurements, and keeps its results under 'baseline'.
"""

import argparse
import hashlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _process_start() -> float:
  """The interpreter's start time (time.time() scale), from /proc."""
  with open('/proc/self/stat') as f:
    ticks = int(f.read().rsplit(')', 1)[1].split()[19])
  with open('/proc/uptime') as f:
    uptime = float(f.read().split()[0])
  return time.time() - uptime + ticks / os.sysconf('SC_CLK_TCK')


PROCESS_START = _process_start()

import input_pipeline as ip  # noqa: E402  (after the start time: imports count)
from configs import multi30k, wmt14_base  # noqa: E402
from nmt import text_io  # noqa: E402
from nmt import train_pipeline as tp  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', default='', help='Keeps tokenizer.model, TFDS data, corpora.')
  parser.add_argument('--json', default='', help='Write the results here as JSON.')
  parser.add_argument('--batches', type=int, default=300)
  parser.add_argument('--warmup', type=int, default=10)
  parser.add_argument('--synthetic_pairs', type=int, default=0,
                      help='Make a corpus of this many pairs from Multi30k lines (0: Multi30k).')
  parser.add_argument('--processes', default='1',
                      help='Comma-separated process counts to run the workers with.')
  parser.add_argument('--spm_sample_size', type=int, default=400_000,
                      help='Tokenizer sample of the synthetic corpus, in sentences.')
  parser.add_argument('--vocab_size', type=int, default=8000,
                      help='Tokenizer vocabulary of the synthetic corpus.')
  parser.add_argument('--bpe_dropout', type=float, default=0.0, help='data.bpe_dropout.')
  parser.add_argument('--packing_bins', type=int, default=0, help="0: the config's.")
  parser.add_argument('--baseline', default='', help="Another checkout to run the benchmark of.")
  parser.add_argument('--process_index', type=int, default=-1, help=argparse.SUPPRESS)
  parser.add_argument('--process_count', type=int, default=1, help=argparse.SUPPRESS)
  parser.add_argument('--state', default='', help=argparse.SUPPRESS)
  parser.add_argument('--restore', action='store_true', help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def write_synthetic_corpus(folder: Path, num_pairs: int, seed: int = 0) -> None:
  """train.{en,de} of num_pairs pairs, each side 1-3 random Multi30k train lines joined."""
  if (folder / 'train.de').is_file():
    return
  source = Path(os.environ[ip.MULTI30K_ENV])
  en, de = (text_io.read_lines(source / f'train.{lang}') for lang in ('en', 'de'))
  rng = random.Random(seed)
  folder.mkdir(parents=True, exist_ok=True)
  with open(folder / 'train.en.tmp', 'w') as f_en, open(folder / 'train.de.tmp', 'w') as f_de:
    for _ in range(num_pairs):
      lines = rng.choices(range(len(en)), k=rng.choice((1, 2, 2, 3)))
      f_en.write(' '.join(en[i] for i in lines) + '\n')
      f_de.write(' '.join(de[i] for i in lines) + '\n')
  for lang in ('en', 'de'):  # train.de last: its presence says the corpus is whole.
    os.replace(folder / f'train.{lang}.tmp', folder / f'train.{lang}')


def make_config(args: argparse.Namespace, workdir: str):
  if not args.synthetic_pairs:
    config = multi30k.get_config()
  else:
    config = wmt14_base.get_config()
    folder = Path(workdir) / f'synthetic_{args.synthetic_pairs}'
    config.data.dataset_name = f'folder:{folder}'
    config.data.spm_sample_size = args.spm_sample_size
    config.model.vocab_size = args.vocab_size  # Multi30k text has too few words for 32k pieces.
  config.data.data_dir = config.data.data_dir or os.path.join(workdir, 'tfds')
  config.data.bpe_dropout = args.bpe_dropout
  config.data.packing_bins = args.packing_bins or config.data.packing_bins
  return config


def machine() -> dict:
  cpu = platform.processor() or platform.machine()
  with open('/proc/cpuinfo', encoding='utf-8') as f:
    info = f.read()
  cpu = next((line.split(':', 1)[1].strip() for line in info.splitlines()
              if line.startswith('model name')), cpu)
  commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
  # Load before the run: other jobs on the machine slow every number here.
  return {'cpu': cpu, 'avx512f': 'avx512f' in info, 'cores': len(os.sched_getaffinity(0)),
          'commit': commit, 'load_average_1min': os.getloadavg()[0],
          'date': time.strftime('%Y-%m-%d')}


def peak_rss_mb() -> float:
  """This process's peak resident memory (VmHWM: ru_maxrss would count a parent's memory at
  the fork that started it)."""
  with open('/proc/self/status') as f:
    return round(next(int(line.split()[1]) for line in f if line.startswith('VmHWM')) / 1024)


def batch_hash(batch: dict) -> str:
  return hashlib.sha256(b''.join(batch[k].tobytes() for k in ip.FEATURE_KEYS)).hexdigest()[:16]


def measure(config, args, workdir: str) -> dict:
  """One worker process's numbers (see the module docstring)."""
  p, count = args.process_index, args.process_count
  results = {'process_index': p, 'process_count': count}
  start = time.time()
  source = ip.open_split(config, config.data.train_split, process_index=p)
  it = tp.TrainIterator(source, tp.Settings.of(config, os.path.join(workdir, 'tokenizer.model')),
                        p, count)
  prefix = 'resume_' if args.restore else ''
  if args.restore:
    saved = json.loads(Path(args.state).read_text())
    it.set_state(saved['state'])
  batch = next(it)
  results.update({f'{prefix}seconds' if args.restore else 'first_batch_seconds':
                  round(time.time() - start, 2),
                  f'{prefix}process_to_first_batch_seconds': round(time.time() - PROCESS_START, 2)})
  if args.restore:
    results['resume_matches'] = batch_hash(batch) == saved['next']
  else:
    results['shards'] = [it.shards[0], it.shards[-1]]
    for _ in range(args.warmup):
      next(it)
    tokens = real = slots = 0
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.batches):
      batch = next(it)
      tokens += int((batch['targets_segmentation'] > 0).sum())
      real += int((batch['inputs_segmentation'] > 0).sum() +
                  (batch['targets_segmentation'] > 0).sum())
      slots += batch['inputs'].size + batch['targets'].size
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    results.update(batches_per_second=round(args.batches / elapsed, 1),
                   target_tokens_per_second=round(tokens / elapsed),
                   target_tokens_per_cpu_second=round(tokens / cpu),
                   packing_efficiency=round(real / slots, 4))
    state = it.get_state()
    Path(args.state).write_text(json.dumps({'state': state, 'next': batch_hash(next(it))}))
    results['state_json_bytes'] = len(json.dumps(state))
  it.close()
  results[f'{prefix}peak_rss_mb'] = peak_rss_mb()
  return results


def run_worker(args, workdir: str, p: int, count: int, restore: bool) -> dict:
  out = os.path.join(workdir, f'worker_{p}_of_{count}{"_resumed" if restore else ""}.json')
  cmd = [sys.executable, '-m', 'benchmarks.input_pipeline', '--workdir', workdir, '--json', out,
         '--batches', str(args.batches), '--warmup', str(args.warmup),
         '--synthetic_pairs', str(args.synthetic_pairs),
         '--spm_sample_size', str(args.spm_sample_size), '--vocab_size', str(args.vocab_size),
         '--bpe_dropout', str(args.bpe_dropout), '--packing_bins', str(args.packing_bins),
         '--process_index', str(p),
         '--process_count', str(count),
         '--state', os.path.join(workdir, f'state_{p}_of_{count}.json')] + (
             ['--restore'] if restore else [])
  subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
  return json.loads(Path(out).read_text())


def run_baseline(args, workdir: str) -> dict:
  """The benchmark of the checkout args.baseline, with these arguments, in this workdir."""
  out = os.path.join(workdir, 'baseline.json')
  cmd = [sys.executable, '-m', 'benchmarks.input_pipeline', '--workdir', workdir, '--json', out,
         '--batches', str(args.batches)]
  if args.synthetic_pairs:
    cmd += ['--synthetic_pairs', str(args.synthetic_pairs), '--processes', args.processes,
            '--one_at_a_time', '--spm_sample_size', str(args.spm_sample_size),
            '--vocab_size', str(args.vocab_size)]
  env = dict(os.environ, PYTHONPATH=os.path.abspath(args.baseline))
  subprocess.run(cmd, cwd=args.baseline, env=env, check=True, stdout=subprocess.DEVNULL)
  return json.loads(Path(out).read_text())


def main(argv=None) -> dict:
  args = parse_args(argv)
  if not os.environ.get(ip.MULTI30K_ENV):
    local = REPO.parent / 'shared' / 'data' / 'multi30k'
    if local.is_dir():  # The checkout's sibling data folder, if any; else TFDS downloads.
      os.environ[ip.MULTI30K_ENV] = str(local)
  workdir = args.workdir or tempfile.mkdtemp(prefix='bench_input_')
  config = make_config(args, workdir)
  if args.process_index >= 0:  # A worker started by run_worker.
    results = measure(config, args, workdir)
  else:
    results = {'machine': machine()}
    if args.synthetic_pairs:
      write_synthetic_corpus(Path(config.data.dataset_name[len('folder:'):]),
                             args.synthetic_pairs)
    marker = Path(workdir) / 'prepared.json'  # What the run that prepared the data measured.
    if not marker.is_file():
      start = time.perf_counter()
      ip.open_split(config, config.data.train_split)
      marker.write_text(json.dumps({'prepare_seconds': round(time.perf_counter() - start, 1),
                                    'prepare_peak_rss_mb': peak_rss_mb()}))
    results.update(json.loads(marker.read_text()))
    start = time.perf_counter()
    ip.load_or_train_tokenizer(config, workdir)
    results['tokenizer_seconds'] = round(time.perf_counter() - start, 1)
    results.update(batch_size=config.data.batch_size, max_length=config.data.max_length,
                   num_shards=config.data.num_shards, packing_bins=config.data.packing_bins,
                   bpe_dropout=config.data.bpe_dropout,
                   vocab_size=config.model.vocab_size, batches=args.batches,
                   pairs=len(ip.open_split(config, config.data.train_split)))
    if args.baseline:
      results['baseline'] = run_baseline(args, workdir)
    results['runs'] = {}
    for count in map(int, args.processes.split(',')):
      results['runs'][str(count)] = [{**run_worker(args, workdir, p, count, False),
                                      **run_worker(args, workdir, p, count, True)}
                                     for p in range(count)]
  for k, v in results.items():
    print(f'{k:>28}: {v}')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=2)
  return results


if __name__ == '__main__':
  main()
