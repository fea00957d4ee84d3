"""Throughput, setup time, resume time and memory of the training input pipeline.

  MULTI30K_DIR=../shared/data/multi30k python -m benchmarks.input_pipeline \
      [--workdir DIR] [--json out.json] [--batches 500]
  MULTI30K_DIR=../shared/data/multi30k python -m benchmarks.input_pipeline \
      --synthetic_pairs 4500000 --processes 1,2 --workdir DIR [--json out.json]

Without --synthetic_pairs: Multi30k train with configs/multi30k.py's data settings, in this
process. With it: N aligned pairs made from Multi30k lines (1-3 lines joined per sentence, so
lengths look like WMT's) in DIR/synthetic_N/train.{en,de}, read through the 'folder:' source
with configs/wmt14_base.py's data settings (max_length 128, batch 192, 64 streams) and an 8k
vocabulary; TFDS preparation and the tokenizer are made once in DIR (reused by later runs),
then for each count P of --processes, P worker processes (process_index 0..P-1 of P) run at
once (or --one_at_a_time) and each reports:

  * read_and_tokenize_seconds, pack_first_epoch_seconds, pairs_per_second (its streams' pairs
    over both), first_batch_seconds (make_train_iterator + the first batch);
  * pack_epoch_seconds: packing the next epoch of all its streams (normally in a thread);
    *_cpu_seconds: the process's CPU time for the same (all its threads), which other jobs on
    the machine change less than the wall time;
  * batches_per_second and tokens/s over --batches batches after --warmup;
  * resume_seconds: a new iterator from the state saved mid-epoch, up to its first batch,
    and whether that batch equals the uninterrupted iterator's; the first iterator keeps the
    tokenized streams in DIR/train_tokens_P (cache_dir), the resumed one reads them back, so
    first_batch_seconds is also what a resume without them costs;
  * peak_rss_mb: the process's peak resident memory (ru_maxrss).
"""

import argparse
import gc
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import input_pipeline as ip
from configs import multi30k, wmt14_base
from nmt import text_io

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', default='', help='Keeps tokenizer.model, TFDS data, corpora.')
  parser.add_argument('--json', default='', help='Write the results here as JSON.')
  parser.add_argument('--batches', type=int, default=500)
  parser.add_argument('--warmup', type=int, default=20)
  parser.add_argument('--synthetic_pairs', type=int, default=0,
                      help='Make a corpus of this many pairs from Multi30k lines (0: Multi30k).')
  parser.add_argument('--processes', default='1',
                      help='Comma-separated process counts to run the workers with.')
  parser.add_argument('--one_at_a_time', action='store_true',
                      help='Run the worker processes one after another, each with the whole '
                      'machine (as hosts with their own cores), instead of at once.')
  parser.add_argument('--spm_sample_size', type=int, default=400_000,
                      help='Tokenizer sample of the synthetic corpus, in sentences.')
  parser.add_argument('--vocab_size', type=int, default=8000,
                      help='Tokenizer vocabulary of the synthetic corpus.')
  parser.add_argument('--process_index', type=int, default=-1, help=argparse.SUPPRESS)
  parser.add_argument('--process_count', type=int, default=1, help=argparse.SUPPRESS)
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
  return config


def machine() -> dict:
  cpu = platform.processor() or platform.machine()
  with open('/proc/cpuinfo', encoding='utf-8') as f:
    cpu = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')),
               cpu)
  commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
  # Load before the run: other jobs on the machine slow every number here.
  return {'cpu': cpu, 'cores': len(os.sched_getaffinity(0)), 'commit': commit,
          'load_average_1min': os.getloadavg()[0]}


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB.


def measure(config, tokenizer, args, cache_dir: str, process_index: int = 0,
            process_count: int = 1) -> dict:
  """One process's numbers (see the module docstring); cache_dir starts without this run's."""
  start, start_cpu = time.perf_counter(), time.process_time()
  it = ip.make_train_iterator(config, tokenizer, process_index=process_index,
                              process_count=process_count, cache_dir=cache_dir)
  made, made_cpu = time.perf_counter() - start, time.process_time() - start_cpu
  start, start_cpu = time.perf_counter(), time.process_time()
  for stream in it.streams:  # One epoch's packing, before any runs in the background.
    stream.pack_epoch(stream.epoch + 1)
  pack_epoch = time.perf_counter() - start
  pack_epoch_cpu = time.process_time() - start_cpu  # What other jobs on the machine don't slow.
  start = time.perf_counter()
  next(it)
  first_batch = made + time.perf_counter() - start
  for _ in range(args.warmup):
    next(it)
  tgt_tokens = src_tokens = slots = 0
  start = time.perf_counter()
  for _ in range(args.batches):
    batch = next(it)
    tgt_tokens += int((batch['targets_segmentation'] > 0).sum())
    src_tokens += int((batch['inputs_segmentation'] > 0).sum())
    slots += batch['inputs'].size + batch['targets'].size
  elapsed = time.perf_counter() - start
  state = it.get_state()
  expected = next(it)
  pairs = sum(s.pairs.num_pairs for s in it.streams)
  results = {
      'process_index': process_index, 'process_count': process_count,
      'streams': [it.streams[0].stream, it.streams[-1].stream], 'pairs': pairs,
      'read_and_tokenize_seconds': round(it.setup_seconds['read_and_tokenize'], 2),
      'pack_first_epoch_seconds': round(it.setup_seconds['pack'], 2),
      'pairs_per_second': round(pairs / sum(it.setup_seconds.values())),
      'first_batch_seconds': round(first_batch, 2),
      'make_iterator_cpu_seconds': round(made_cpu, 2),
      'pack_epoch_seconds': round(pack_epoch, 2),
      'pack_epoch_cpu_seconds': round(pack_epoch_cpu, 2),
      'batches_per_epoch': min(it.epoch_batches),
      'batches_per_second': round(args.batches / elapsed, 1),
      'target_tokens_per_second': round(tgt_tokens / elapsed),
      'real_tokens_per_second': round((tgt_tokens + src_tokens) / elapsed),
      'total_slots_per_second': round(slots / elapsed),
      'packing_efficiency': round(it.packing_efficiency, 4),
      'measured_nonpad_share': round((tgt_tokens + src_tokens) / slots, 4),
      'final_state': state,
  }
  it.close()
  del it
  gc.collect()
  start = time.perf_counter()
  resumed = ip.make_train_iterator(config, tokenizer, process_index=process_index,
                                   process_count=process_count, state=state, cache_dir=cache_dir)
  batch = next(resumed)
  results['resume_seconds'] = round(time.perf_counter() - start, 2)
  results['resume_matches'] = all(np.array_equal(batch[k], expected[k]) for k in ip.FEATURE_KEYS)
  resumed.close()
  results['peak_rss_mb'] = round(peak_rss_mb())
  return results


def run_workers(args, workdir: str, process_count: int) -> list[dict]:
  """process_count worker processes at once; each one's results."""
  shutil.rmtree(cache_dir(workdir, process_count), ignore_errors=True)
  procs, outputs = [], []
  for p in range(process_count):
    out = os.path.join(workdir, f'worker_{p}_of_{process_count}.json')
    outputs.append(out)
    cmd = [sys.executable, '-m', 'benchmarks.input_pipeline', '--workdir', workdir,
           '--json', out, '--batches', str(args.batches), '--warmup', str(args.warmup),
           '--synthetic_pairs', str(args.synthetic_pairs),
           '--spm_sample_size', str(args.spm_sample_size), '--vocab_size', str(args.vocab_size),
           '--process_index', str(p), '--process_count', str(process_count)]
    procs.append(subprocess.Popen(cmd, cwd=REPO))
    if args.one_at_a_time or p == process_count - 1:
      for proc in procs:
        if proc.wait():
          raise RuntimeError(f'{proc.args} exited with {proc.returncode}.')
  return [json.loads(Path(out).read_text()) for out in outputs]


def cache_dir(workdir: str, process_count: int) -> str:
  """Tokenized streams of the runs with process_count processes (made by their first iterator)."""
  return os.path.join(workdir, f'train_tokens_{process_count}')


def main(argv=None) -> dict:
  args = parse_args(argv)
  if not os.environ.get(ip.MULTI30K_ENV):
    local = REPO.parent / 'shared' / 'data' / 'multi30k'
    if local.is_dir():  # The checkout's sibling data folder, if any; else TFDS downloads.
      os.environ[ip.MULTI30K_ENV] = str(local)
  workdir = args.workdir or tempfile.mkdtemp(prefix='bench_input_')
  config = make_config(args, workdir)

  if args.process_index >= 0:  # A worker started by run_workers.
    tokenizer = ip.load_tokenizer(os.path.join(workdir, 'tokenizer.model'))
    results = measure(config, tokenizer, args, cache_dir(workdir, args.process_count),
                      args.process_index, args.process_count)
  else:
    results = {'machine': machine()}
    if args.synthetic_pairs:
      start = time.perf_counter()
      write_synthetic_corpus(Path(config.data.dataset_name[len('folder:'):]),
                             args.synthetic_pairs)
      results['corpus_seconds'] = round(time.perf_counter() - start, 1)
      start = time.perf_counter()
      ip.prepared_builder(config)
      results['tfds_prepare_seconds'] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    tokenizer = ip.load_or_train_tokenizer(config, workdir)
    results['tokenizer_seconds'] = round(time.perf_counter() - start, 1)
    results.update(batch_size=config.data.batch_size, max_length=config.data.max_length,
                   num_streams=config.data.num_streams, vocab_size=tokenizer.vocab_size,
                   batches=args.batches)
    if args.synthetic_pairs:
      results.update(pairs=args.synthetic_pairs, one_at_a_time=args.one_at_a_time)
      results['runs'] = {str(p): run_workers(args, workdir, p)
                         for p in map(int, args.processes.split(','))}
    else:
      shutil.rmtree(cache_dir(workdir, 1), ignore_errors=True)
      results.update(measure(config, tokenizer, args, cache_dir(workdir, 1)))
  for k, v in results.items():
    print(f'{k:>28}: {v}')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=2)
  return results


if __name__ == '__main__':
  main()
