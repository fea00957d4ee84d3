"""Mutation check: one-line breakages of the model, the searches and training, each of which the
fast test set must catch.

  nice -n 10 python tests/mutations.py [--json out.json] [--only name,name] [--list] [--keep]
      [--exclude tests/test_formulas.py]

Each mutation is a text substitution in one product file. For each, alone: the repository is
copied to a temporary folder (without .git, .venv, runs, caches), the substitution applied
there, and `python -m pytest -x -q -n 0 -m 'not slow' -p no:cacheprovider` run in the copy, first on
the test files most likely to catch it, then, if none failed, on the rest of the fast set. A
mutation is caught when some fast test fails (or a test file no longer imports); -x stops at
the first failure. A failing test outside the files the baseline checked counts only if it
passes without the mutation; else it is recorded as failing already, left out, and the run
goes on. The original text must occur exactly once in its file: a mutation whose text the
code no longer holds stops the script with an error instead of passing unnoticed.

Before the mutations, the unmutated copy runs the first-choice test files, which must pass.
`--exclude` leaves test files out, e.g. this check's own tests/test_formulas.py, to see what the
rest of the fast set catches (a mutation it misses costs a run of the whole fast set).
Prints a markdown table at the end; --json also writes the results with the machine.
Not collected by pytest (its name does not start with test_).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One process (-n 0), so the files most likely to catch a mutation run first, in order.
PYTEST = [sys.executable, '-m', 'pytest', '-x', '-q', '-n', '0', '-m', 'not slow', '-p',
          'no:cacheprovider']
COPY_IGNORE = shutil.ignore_patterns('.git', '.venv', 'runs', 'build', '__pycache__',
                                     '*.egg-info', '.pytest_cache', '.ruff_cache')
FORMULAS = 'tests/test_formulas.py'
# tests/conftest.py finds the Multi30k files beside the repository, which a temporary copy is
# not: the copies' tests are pointed at the original's, so the tests that need them run.
MULTI30K = os.path.join(os.path.dirname(REPO), 'shared', 'data', 'multi30k')


@dataclasses.dataclass(frozen=True)
class Mutation:
  name: str
  path: str  # Relative to the repository.
  original: str  # Must occur exactly once in the file.
  replacement: str
  what: str  # The breakage in words.
  first: tuple[str, ...] = (FORMULAS,)  # Test files run before the rest of the fast set.


MUTATIONS = [
    Mutation('scaled_dot_loses_scale', 'model/transformer.py',
             '      return query / np.sqrt(c.head_dim).astype(query.dtype)',
             '      return query',
             "scaled_dot's explicit path (score_query) drops 1/sqrt(d_k)"),
    Mutation('fused_attention_loses_scale', 'model/transformer.py',
             'jax.nn.dot_product_attention(query, keys, values, mask=mask,',
             'jax.nn.dot_product_attention(query, keys, values, mask=mask, scale=1.0,',
             "the paper's fused attention path drops 1/sqrt(d_k)"),
    Mutation('dot_gets_scaled', 'model/transformer.py',
             '    return query\n\n  def additive_scores',
             '    return query / np.sqrt(c.head_dim).astype(query.dtype)\n\n'
             '  def additive_scores',
             "'dot' divides its scores by sqrt(d_k)"),
    Mutation('additive_is_scaled_dot', 'model/transformer.py',
             '    hidden = jnp.tanh(query[..., None].astype(jnp.float32) + '
             'keys[:, :, None].astype(jnp.float32))\n'
             "    return jnp.einsum('bhqdk,hd->bhqk', hidden, "
             'self.score_vector.astype(jnp.float32))',
             "    return jnp.einsum('bhqd,bhdk->bhqk', query, keys, "
             'preferred_element_type=jnp.float32) / np.sqrt(query.shape[-1])',
             "additive_scores' body replaced by the scaled dot product"),
    Mutation('bilinear_kernel_transposed', 'model/transformer.py',
             "jnp.einsum('...hd,hde->...he', query, self.score_kernel",
             "jnp.einsum('...he,hde->...hd', query, self.score_kernel",
             'bilinear computes q^T W^T k instead of q^T W k'),
    Mutation('bilinear_kernel_starts_at_zero', 'model/transformer.py',
             'jnp.eye(c.head_dim, dtype=dtype) / np.sqrt(c.head_dim), shape),',
             'jnp.zeros((c.head_dim, c.head_dim), dtype), shape),',
             'the bilinear kernel is initialised as zeros, not I / sqrt(d_k)'),
    Mutation('embedding_scale_dropped', 'model/transformer.py',
             'x = table(tokens) * jnp.sqrt(jnp.asarray(c.d_model, c.dtype))',
             'x = table(tokens)',
             'token embeddings lose their sqrt(d_model) factor'),
    Mutation('causal_mask_sees_next_token', 'model/masks.py',
             'mask &= jnp.arange(q_len)[:, None] >= jnp.arange(k_len)[None, :]',
             'mask &= jnp.arange(q_len)[:, None] + 1 >= jnp.arange(k_len)[None, :]',
             'the causal mask lets query i see key i + 1'),
    Mutation('positions_shifted_by_one', 'model/masks.py',
             'return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)',
             'return jnp.broadcast_to(jnp.arange(1, tokens.shape[1] + 1), tokens.shape)',
             'default positions start at 1 instead of 0'),
    Mutation('sparsemax_support_one_short', 'model/probability_maps.py',
             'support_size = jnp.sum(1 + k * sorted_z > cumulative, axis=-1, keepdims=True)',
             'support_size = jnp.maximum(jnp.sum(1 + k * sorted_z > cumulative, axis=-1, '
             'keepdims=True) - 1, 1)',
             "sparsemax's threshold from a support one too small"),
    Mutation('entmax15_loses_the_half', 'model/probability_maps.py',
             '  z = z / 2\n',
             '  z = z\n',
             '1.5-entmax uses z instead of (alpha - 1) z = z / 2'),
    Mutation('linear_feature_map_relu', 'model/linear_attention.py',
             'return jax.nn.elu(x.astype(jnp.float32)) + 1',
             'return jax.nn.relu(x.astype(jnp.float32)) + 1',
             'linear attention feature map relu(x) + 1 instead of elu(x) + 1'),
    Mutation('linear_causal_sees_next_token', 'model/linear_attention.py',
             'last = jnp.minimum(last, jnp.arange(query.shape[1], dtype=jnp.int32))',
             'last = jnp.minimum(last, jnp.arange(query.shape[1], dtype=jnp.int32) + 1)',
             "causal linear attention's prefix sums include the next key"),
    Mutation('linear_decoding_state_forgets', 'model/linear_attention.py',
             'return state + outer.reshape(state.shape)',
             'return outer.reshape(state.shape)',
             "the decoding state keeps only this step's key/value"),
    Mutation('length_penalty_not_applied', 'model/search.py',
             'fin_cand = jnp.where(newly_finished, cand_log_probs / penalty, NEG_INF)',
             'fin_cand = jnp.where(newly_finished, cand_log_probs, NEG_INF)',
             'beam search ranks finished hypotheses without the length penalty'),
    Mutation('length_penalty_ignores_alpha', 'model/search.py',
             'return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha',
             'return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** 1.0',
             'length_penalty ignores alpha (exponent 1)'),
    Mutation('label_smoothing_dropped', 'nmt/optimization.py',
             '  smoothed = (confidence - low) * nll - low * (logits.sum(-1) - vocab * '
             'log_normaliser)\n',
             '  smoothed = nll\n',
             "cross_entropy's loss is the plain NLL (less the smoothed targets' entropy)"),
    Mutation('train_step_ignores_label_smoothing', 'nmt/optimization.py',
             'label_smoothing=config.optimizer.label_smoothing,',
             'label_smoothing=0.0,',
             "the compiled train step ignores the config's label smoothing"),
    Mutation('warmup_exponent_changed', 'nmt/optimization.py',
             'rate = scale * jnp.minimum(step**-0.5, step * warmup**-1.5)',
             'rate = scale * jnp.minimum(step**-0.5, step * warmup**-1.0)',
             'warmup slope step * warmup^-1 instead of step * warmup^-1.5'),
    Mutation('schedule_counts_steps_from_0', 'nmt/optimization.py',
             'step = jnp.asarray(count, jnp.float32) + 1.0',
             'step = jnp.asarray(count, jnp.float32)',
             'the schedule reads step = count (from 0) instead of count + 1'),
    Mutation('cooldown_one_step_early', 'nmt/optimization.py',
             'rate *= jnp.clip((last_step + 1 - step) / cooldown, 0.0, 1.0)',
             'rate *= jnp.clip((last_step - step) / cooldown, 0.0, 1.0)',
             'the cooldown reaches 0 one step before the last'),
    Mutation('rnn_general_drops_W', 'model/rnn.py',
             "return memory if self.config.attention_score == 'dot' else",
             "return memory if self.config.attention_score in ('dot', 'general') else",
             "Luong's general score h^T W e loses W (becomes dot)"),
    Mutation('rnn_additive_drops_tanh', 'model/rnn.py',
             'hidden = jnp.tanh(projected[:, :, None, :] + memory_keys[:, None, :, :])',
             'hidden = projected[:, :, None, :] + memory_keys[:, None, :, :]',
             "Bahdanau's v^T tanh(W h + U e) loses the tanh"),
    Mutation('rnn_input_feeding_off', 'model/rnn.py',
             "x = jnp.concatenate([embedded, carry['feed']], -1) if c.input_feeding else embedded",
             'x = embedded',
             'input feeding turned off (the previous attentional vector is not fed)'),
    Mutation('rnn_attentional_vector_drops_tanh', 'model/rnn.py',
             'attentional = jnp.tanh(nn.Dense(',
             'attentional = (nn.Dense(',
             'a_t = W_c [c_t; h_t] without the tanh'),
]


def apply_mutation(root: str, mutation: Mutation) -> None:
  """Substitutes the mutation's text in its file under `root`; raises unless the original
  occurs exactly once."""
  path = os.path.join(root, mutation.path)
  with open(path, encoding='utf-8') as f:
    text = f.read()
  count = text.count(mutation.original)
  if count != 1:
    raise RuntimeError(f'mutation {mutation.name!r}: its original text occurs {count} times in '
                       f'{mutation.path} (must be exactly once); update the mutation to the code:'
                       f'\n{mutation.original}')
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text.replace(mutation.original, mutation.replacement))


def copy_repo(destination: str) -> str:
  root = os.path.join(destination, 'repo')
  shutil.copytree(REPO, root, ignore=COPY_IGNORE)
  return root


def run_pytest(root: str, args: list[str], timeout: float) -> dict:
  """pytest in `root` (its copy of the code first on sys.path): exit code, the first failing
  test (or collection error) and the output's tail."""
  # A wide terminal, so pytest's summary line keeps the failure's message after the test id.
  env = dict(os.environ, PYTHONPATH=root, PYTHONDONTWRITEBYTECODE='1', COLUMNS='400')
  if 'MULTI30K_DIR' not in env and os.path.isdir(MULTI30K):
    env['MULTI30K_DIR'] = MULTI30K
  start = time.monotonic()
  try:
    done = subprocess.run(PYTEST + args, cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
  except subprocess.TimeoutExpired as e:
    output = (e.stdout or b'').decode() if isinstance(e.stdout, bytes) else (e.stdout or '')
    return {'returncode': None, 'failed': None, 'message': None,
            'seconds': time.monotonic() - start,
            'tail': output[-2000:] + f'\nTIMEOUT after {timeout} s'}
  output = done.stdout + done.stderr
  failed = re.findall(r'^(?:FAILED|ERROR) (\S+)(?: - (.*))?$', output, flags=re.MULTILINE)
  return {'returncode': done.returncode, 'failed': failed[0][0] if failed else None,
          'message': failed[0][1][:300] if failed else None,
          'seconds': time.monotonic() - start, 'tail': output[-2000:]}


class Original:
  """One unmutated copy of the repository, made on first use: a test that fails there fails
  for another reason than the mutation (a failure already on the branch)."""

  def __init__(self, timeout: float):
    self.timeout = timeout
    self.workdir = None
    self.verdicts: dict[str, bool] = {}

  def passes(self, test: str) -> bool:
    if test not in self.verdicts:
      if self.workdir is None:
        self.workdir = tempfile.mkdtemp(prefix='mutation_original_')
        copy_repo(self.workdir)
      run = run_pytest(os.path.join(self.workdir, 'repo'), [test], self.timeout)
      self.verdicts[test] = run['returncode'] == 0
    return self.verdicts[test]

  def close(self):
    if self.workdir is not None:
      shutil.rmtree(self.workdir, ignore_errors=True)


MAX_PREEXISTING = 5  # Failures of the unmutated code stepped over before giving up.


def check_mutation(mutation: Mutation, timeout: float, keep: bool, original: Original,
                   exclude: tuple[str, ...] = (), first_checked: bool = True) -> dict:
  """Applies `mutation` to a fresh copy and runs the fast set (first-choice files first),
  leaving out the test files `exclude`. A failing test outside the first-choice files (all of
  them unless `first_checked`, the baseline's) counts only if it passes on the unmutated code;
  otherwise it is left out and the run goes on."""
  workdir = tempfile.mkdtemp(prefix=f'mutation_{mutation.name}_')
  start = time.monotonic()
  try:
    root = copy_repo(workdir)
    apply_mutation(root, mutation)
    first = [path for path in mutation.first if path not in exclude]
    rest = ['tests'] + [f'--ignore={path}' for path in (*mutation.first, *exclude)]
    phases = [first, rest] if first else [rest]
    runs, preexisting = [], []
    for phase, args in enumerate(phases, start=1):
      while True:
        left_out = [f'--deselect={t}' if '::' in t else f'--ignore={t}' for t in preexisting]
        run = {'phase': phase, 'args': args + left_out, **run_pytest(root, args + left_out,
                                                                     timeout)}
        runs.append(run)
        unconfirmed = run['failed'] and (phase > 1 or not first or not first_checked)
        if (unconfirmed and len(preexisting) < MAX_PREEXISTING
            and not original.passes(run['failed'])):
          preexisting.append(run['failed'])
          continue
        break
      if run['returncode'] != 0:  # A failure, or an error that stops the check.
        break
    last = runs[-1]
    # Exit 1: a test failed; 2: interrupted, e.g. by a test file that no longer imports.
    caught = last['returncode'] in (1, 2) and last['failed'] is not None and (
        last['failed'] not in preexisting)
    status = 'caught' if caught else ('not caught' if last['returncode'] == 0 else 'error')
    for run in runs[:-1] if not caught else runs:  # The output only where it explains more.
      run.pop('tail')
    return {'name': mutation.name, 'file': mutation.path, 'what': mutation.what,
            'status': status, 'caught': caught, 'failing_test': last['failed'],
            'message': last.get('message'), 'phase': last['phase'],
            'preexisting_failures': preexisting,
            'seconds': round(time.monotonic() - start, 1), 'runs': runs}
  finally:
    if keep:
      print(f'  kept {workdir}', flush=True)
    else:
      shutil.rmtree(workdir, ignore_errors=True)


def baseline(mutations: list[Mutation], timeout: float, exclude: tuple[str, ...] = ()) -> dict:
  """The unmutated copy must import its own code and pass every first-choice test file, or no
  result means anything."""
  files = sorted({path for m in mutations for path in m.first} - set(exclude))
  workdir = tempfile.mkdtemp(prefix='mutation_baseline_')
  try:
    root = copy_repo(workdir)
    # The copy's code is what its processes import (not an installed or editable package).
    imported = subprocess.run(
        [sys.executable, '-c', 'import model, nmt; print(model.__file__, nmt.__file__)'],
        cwd=root, env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True,
        check=True).stdout.split()
    if not all(os.path.realpath(path).startswith(os.path.realpath(root)) for path in imported):
      raise RuntimeError(f'the copy in {root} imports {imported}, not its own code')
    run = run_pytest(root, files, timeout) if files else {'returncode': 0, 'seconds': 0.0}
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  if run['returncode'] != 0:
    raise RuntimeError(f'the unmutated code fails {files}:\n{run["tail"]}')
  return {'files': files, 'seconds': round(run['seconds'], 1)}


def machine() -> dict:
  cpu = ''
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      text = f.read()
    cpu = re.search(r'^model name\s*:\s*(.*)$', text, re.MULTILINE).group(1)
    avx512 = 'avx512f' in text
  except (OSError, AttributeError):
    avx512 = None
  return {'cpu': cpu, 'avx512f': avx512, 'cores': os.cpu_count(),
          'python': platform.python_version(), 'niceness': os.nice(0)}


def git_commit() -> str:
  try:
    return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return ''


def markdown(results: list[dict]) -> str:
  lines = ['| mutation | file | breakage | caught by | seconds |', '|---|---|---|---|---|']
  for r in results:
    by = f'`{r["failing_test"]}`' if r['caught'] else f'**{r["status"].upper()}**'
    lines.append(f'| {r["name"]} | {r["file"]} | {r["what"]} | {by} | {r["seconds"]:.0f} |')
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--json', help='write the results here')
  parser.add_argument('--only', default='', help='comma-separated mutation names')
  parser.add_argument('--list', action='store_true', help='list the mutations and exit')
  parser.add_argument('--keep', action='store_true', help='keep the mutated copies')
  parser.add_argument('--no-baseline', action='store_true',
                      help='skip the unmutated run of the first-choice test files')
  parser.add_argument('--exclude', action='append', default=[], metavar='TEST_FILE',
                      help='leave this test file out (repeatable), e.g. tests/test_formulas.py '
                      'to see what the rest of the fast set catches')
  parser.add_argument('--timeout', type=float, default=7200.0,
                      help='seconds per pytest run (the whole fast set takes tens of minutes)')
  args = parser.parse_args(argv)
  by_name = {m.name: m for m in MUTATIONS}
  if len(by_name) != len(MUTATIONS):
    raise RuntimeError('two mutations share a name')
  if args.list:
    for m in MUTATIONS:
      print(f'{m.name:36s} {m.path:28s} {m.what}')
    return 0
  names = [n.strip() for n in args.only.split(',') if n.strip()] or list(by_name)
  unknown = sorted(set(names) - set(by_name))
  if unknown:
    parser.error(f'unknown mutations: {unknown}; --list shows them')
  selected = [by_name[n] for n in names]
  for m in selected:  # Every original text is checked before anything runs.
    with open(os.path.join(REPO, m.path), encoding='utf-8') as f:
      count = f.read().count(m.original)
    if count != 1:
      raise RuntimeError(f'mutation {m.name!r}: its original text occurs {count} times in '
                         f'{m.path} (must be exactly once):\n{m.original}')
  started = time.monotonic()
  report = {'date': datetime.datetime.now().isoformat(timespec='seconds'),
            'commit': git_commit(), 'machine': machine(), 'pytest': ' '.join(PYTEST[1:]),
            'excluded': args.exclude}
  if not args.no_baseline:
    print('baseline (unmutated) ...', flush=True)
    report['baseline'] = baseline(selected, args.timeout, tuple(args.exclude))
    print(f'  passes in {report["baseline"]["seconds"]:.0f} s', flush=True)
  results = []
  original = Original(args.timeout)
  try:
    for m in selected:
      print(f'{m.name} ...', flush=True)
      result = check_mutation(m, args.timeout, args.keep, original, tuple(args.exclude),
                              first_checked=not args.no_baseline)
      results.append(result)
      print(f'  {result["status"]}: {result["failing_test"]} ({result["seconds"]:.0f} s)'
            + (f'; failing without the mutation too: {result["preexisting_failures"]}'
               if result['preexisting_failures'] else ''), flush=True)
      if args.json:  # Written after every mutation, so a long run can be followed.
        write_json(args.json, {**report, 'results': results})
  finally:
    original.close()
  report['results'] = results
  report['seconds'] = round(time.monotonic() - started, 1)
  if args.json:
    write_json(args.json, report)
  print()
  print(markdown(results))
  missed = [r['name'] for r in results if not r['caught']]
  print(f'\n{len(results) - len(missed)}/{len(results)} caught in {report["seconds"]:.0f} s'
        + (f'; not caught: {", ".join(missed)}' if missed else ''))
  return 1 if missed else 0


def write_json(path: str, data: dict) -> None:
  with open(path + '.tmp', 'w', encoding='utf-8') as f:
    json.dump(data, f, indent=1)
    f.write('\n')
  os.replace(path + '.tmp', path)


if __name__ == '__main__':
  sys.exit(main())
