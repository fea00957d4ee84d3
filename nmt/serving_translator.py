"""The exported translator: beam search, n-best lists and forced decoding with the programs
`export.py --format jax` writes, using only jax, numpy, sentencepiece and flatbuffers.

It lives in `nmt/` in a checkout; `export.py` copies it flat into the exported folder, beside
`serving.py` (which imports it from there), so it imports nothing of this project: only the
standard library, jax, numpy and sentencepiece.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import sentencepiece as spm


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


def batch_rows(count: int) -> int:
  """Batch rows for `count` sentences: the next power of two (few shapes to compile)."""
  return 1 << (max(count, 1) - 1).bit_length()


class ExportedTranslator:
  """Beam-search translation with the exported programs, batched by source length.

  A call's sentences, sorted by length, share searches: each search runs in the bucket of its
  longest source, its rows (a power of two) times that bucket within `batch_tokens`. Each
  (program, bucket, rows) shape compiles once, on first use. A call with more sentences than
  the continuous batching slots of a CPU export decodes them with continuous batching (one
  program per bucket), the same translations. `translate_details` also gives the n-best list,
  scores, per-piece log-probabilities, alignments and cross-attention (folders exported with
  the n-best and forced decoding programs). Not thread-safe: one caller at a time (the HTTP
  server's `Batcher` is the only one there).
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
    self.beam_size = self.manifest['beam_size']
    # Continuous batching programs (folders exported for the CPU): their slots and queue sizes.
    self.continuous = self.manifest.get('continuous') or {}
    # The n-best search and forced decoding per bucket (target lengths by bucket); folders
    # exported before them translate but give no details.
    self.forced_lengths = {int(b): n for b, n in (self.manifest.get('forced') or {}).items()}
    self.has_details = bool(self.forced_lengths) and 'nbest' in self.manifest
    # The slot pool (`model/cpu/slot_pool.py`, CPU exports): the HTTP server's continuous
    # batching (folders exported before its start widths translate in batches).
    self.has_pool = 'start_widths' in (self.manifest.get('pool') or {})
    # The programs run only on the platform they were exported for: refuse here, not at the
    # first translation.
    exported_for, platform = self.manifest['platform'], jax.export.default_export_platform()
    if exported_for != platform:
      raise ValueError(f'{folder} was exported for {exported_for} and jax here runs on '
                       f'{platform}: export it with `export.py --format jax --platform '
                       f'{platform}`, or translate on a {exported_for} machine.')
    files = ['tokenizer.model', 'params.npz'] + [f'translator_{b}.jax' for b in self.buckets]
    files += [f'continuous_{b}.jax' for b in self.continuous.get('sizes', {})]
    if self.has_details:
      files += [f'{name}_{b}.jax' for b in self.buckets for name in ('nbest', 'forced')]
    if self.has_pool:
      files += ['pool_init.jax']
      files += [f'pool_start_{w}.jax' for w in self.manifest['pool']['start_widths']]
      files += [f'pool_{name}_{n}.jax' for n in self.manifest['pool']['sizes']
                for name in ('put', 'step')]
    missing = [name for name in files if not os.path.isfile(os.path.join(folder, name))]
    if missing:
      raise FileNotFoundError(f'{folder} lacks {", ".join(missing)}: copy the whole folder '
                              'written by export.py --format jax.')
    self._sp = spm.SentencePieceProcessor(model_file=os.path.join(folder, 'tokenizer.model'))
    with np.load(os.path.join(folder, 'params.npz')) as arrays:
      self._params = jax.device_put(_unflatten({k: arrays[k] for k in arrays.files}))
    self._folder = folder
    self._programs: dict[str, jax.export.Exported] = {}
    self._jitted: dict[str, Any] = {}
    self.searches = 0  # Programs run (searches and forced decodings), for tests and /health.
    self.shapes: set[tuple[str, int]] = set()  # (program, rows) run so far: what compiled.

  def _program(self, name: str) -> jax.export.Exported:
    if name not in self._programs:
      with open(os.path.join(self._folder, f'{name}.jax'), 'rb') as f:
        self._programs[name] = jax.export.deserialize(bytearray(f.read()))
    return self._programs[name]

  def _call(self, name: str, *arrays: np.ndarray) -> list[np.ndarray]:
    """The program `name` on the parameters and `arrays`; its results on the host."""
    self.searches += 1
    self.shapes.add((name, arrays[0].shape[0]))
    results = self._program(name).call(self._params, *(jnp.asarray(a) for a in arrays))
    return [np.asarray(r) for r in results]  # One copy to the host, not one per row.

  def _text(self, sequence: np.ndarray) -> str:
    """A hypothesis' text: its tokens up to EOS, detokenized."""
    tokens = sequence.tolist()
    end = tokens.index(self.eos_id) if self.eos_id in tokens else len(tokens)
    return self._sp.decode([t for t in tokens[:end] if t != self.pad_id])

  def _bucket(self, length: int) -> int:
    return next(b for b in self.buckets if b >= length)

  def encode(self, sources: Sequence[str]) -> list[list[int]]:
    """Token ids of `sources` as the searches read them (EOS included), not cut."""
    return self._sp.encode(list(sources), out_type=int, add_eos=True)

  def count_tokens(self, sources: Sequence[str]) -> int:
    """Source tokens of `sources` as the searches read them (EOS included, empty lines 0)."""
    return sum(len(x) for text, x in zip(sources, self.encode(sources)) if text.strip())

  def _call_tree(self, name: str, *args: Any) -> Any:
    """The slot pool's program `name` on `args` (pytrees), after the parameters for those that
    read them (start and step); the results stay on the device. A put or step consumes the
    pool state it is given (its buffers are reused)."""
    self.searches += 1
    if name not in self._jitted:  # Jitted once: a call of its compiled program is cheap.
      program = self._program(name)
      donate = {'pool_step': 1, 'pool_put': 0}.get(name.rsplit('_', 1)[0], ())
      self._jitted[name] = jax.jit(program.call, donate_argnums=donate)
    if name == 'pool_init' or name.startswith('pool_put'):
      return self._jitted[name](*args)
    return self._jitted[name](self._params, *args)

  def _encode(self, sources: Sequence[str], first_line: int) -> tuple[list[list[int]], list[int]]:
    """Token ids of `sources` (EOS included; longer than the largest bucket: cut, with a
    warning calling sources[0] line `first_line`), and the indices of the nonempty ones."""
    ids = self._sp.encode(list(sources), out_type=int, add_eos=True)
    longest = self.buckets[-1]
    nonempty = []
    for i, (text, tokens) in enumerate(zip(sources, ids)):
      if not text.strip():
        continue
      if len(tokens) > longest:
        print(f'warning: line {first_line + i} has {len(tokens)} tokens; cut to {longest}.',
              file=sys.stderr)
        ids[i] = tokens[:longest - 1] + [self.eos_id]
      nonempty.append(i)
    return ids, nonempty

  def _groups(self, ids: list[list[int]], members: list[int]) -> list[tuple[int, list[int]]]:
    """`members` (indices into `ids`) as searches, shortest first: per search its bucket (that
    of its longest source) and its sentences, sorted by length (they end at about the same
    step), as many as fit `batch_tokens` with the rows rounded up to a power of two (a lone
    sentence always fits)."""
    groups: list[list[int]] = []
    for i in sorted(members, key=lambda i: len(ids[i])):
      rows = batch_rows(len(groups[-1]) + 1) if groups else 0
      if groups and rows * self._bucket(len(ids[i])) <= self.batch_tokens:
        groups[-1].append(i)
      else:
        groups.append([i])
    return [(self._bucket(len(ids[group[-1]])), group) for group in groups]

  def _inputs(self, rows: list[list[int]], width: int) -> np.ndarray:
    """`rows` of ids padded to [batch_rows(len(rows)), width] int32."""
    inputs = np.full((batch_rows(len(rows)), width), self.pad_id, np.int32)
    for row, tokens in enumerate(rows):
      inputs[row, :len(tokens)] = tokens
    return inputs

  def _continuous(self, ids: list[list[int]], members: list[int], outputs: list[str]) -> None:
    """outputs[members] by continuous batching: longest first, per queue the smallest bucket
    that holds its longest sentence and as many sentences as its program takes."""
    members = sorted(members, key=lambda i: -len(ids[i]))
    start = 0
    while start < len(members):
      length = self._bucket(len(ids[members[start]]))
      size = self.continuous['sizes'][str(length)]
      queue = members[start:start + size]
      sources = np.full((size, length), self.pad_id, np.int32)
      for row, i in enumerate(queue):
        sources[row, :len(ids[i])] = ids[i]
      self.searches += 1
      self.shapes.add((f'continuous_{length}', size))
      sequences, _ = self._program(f'continuous_{length}').call(
          self._params, jnp.asarray(sources), jnp.int32(len(queue)))
      sequences = np.asarray(sequences)
      for row, i in enumerate(queue):
        outputs[i] = self._text(sequences[row, 0])
      start += size

  def translate(self, sources: Sequence[str], first_line: int = 1) -> list[str]:
    """Translations of `sources`, in their order; warnings call sources[0] line `first_line`."""
    ids, nonempty = self._encode(sources, first_line)
    outputs = [''] * len(sources)
    if self.continuous and len(nonempty) > self.continuous['slots']:
      self._continuous(ids, nonempty, outputs)
      return outputs
    for length, group in self._groups(ids, nonempty):
      sequences, _ = self._call(f'translator_{length}',
                                self._inputs([ids[i] for i in group], length))
      for row, i in enumerate(group):
        outputs[i] = self._text(sequences[row, 0])
    return outputs

  def translate_details(self, sources: Sequence[str], nbest: int = 1, attention: bool = False,
                        first_line: int = 1) -> list[list[dict[str, Any]]]:
    """Per source its `nbest` best translations (none for an empty source), best first.

    nbest 1 is `translate`'s search; nbest > 1 the first of the beam_size best (the search
    then runs until no live hypothesis beats its beam_size-th finished one, so its best may
    differ from nbest 1's, as with decode.py --nbest). Each translation is a dict: text;
    score (length-penalised, as the search ranks); log_prob; tokens (the pieces, '</s>'
    last); token_log_probs (the model's teacher-forced log-probability of each piece, summing
    to log_prob); source_tokens (the source's pieces as the encoder reads them, '</s>' last);
    align (per piece of tokens, the index of the source piece it attends to most); with
    `attention`, attention [len(tokens)][len(source_tokens)]: the cross-attention weights
    averaged over the decoder's layers and heads (each row sums to 1).
    """
    if not self.has_details:
      raise ValueError(f'{self._folder} has no n-best or forced decoding programs: export it '
                       'again with this export.py.')
    if not 1 <= nbest <= self.beam_size:
      raise ValueError(f'nbest must be from 1 to the beam size {self.beam_size}, got {nbest}.')
    ids, nonempty = self._encode(sources, first_line)
    outputs: list[list[dict[str, Any]]] = [[] for _ in sources]
    pairs: list[tuple[int, int, list[int], dict[str, Any]]] = []  # (bucket, i, target, out)
    for length, group in self._groups(ids, nonempty):
      name = f'translator_{length}' if nbest == 1 else f'nbest_{length}'
      sequences, scores = self._call(name, self._inputs([ids[i] for i in group], length))
      for row, i in enumerate(group):
        for k in range(nbest):
          if not np.isfinite(scores[row, k]):  # Fewer possible translations than nbest.
            continue
          tokens = sequences[row, k].tolist()
          end = tokens.index(self.eos_id) + 1 if self.eos_id in tokens else len(tokens)
          target = [t for t in tokens[:end] if t != self.pad_id]
          output = {'text': self._text(sequences[row, k]), 'score': float(scores[row, k])}
          outputs[i].append(output)
          pairs.append((length, i, target, output))
    for length in sorted({pair[0] for pair in pairs}):
      batch = [pair for pair in pairs if pair[0] == length]
      rows = batch_rows(max(1, self.batch_tokens // length))
      for start in range(0, len(batch), rows):
        chunk = batch[start:start + rows]
        token_log_probs, cross = self._call(
            f'forced_{length}', self._inputs([ids[i] for _, i, _, _ in chunk], length),
            self._inputs([target for _, _, target, _ in chunk], self.forced_lengths[length]))
        for row, (_, i, target, output) in enumerate(chunk):
          weights = cross[row, :, :len(target), :len(ids[i])].mean(axis=0)
          log_probs = token_log_probs[row, :len(target)]
          output.update(
              log_prob=float(log_probs.sum()), tokens=self._pieces(target),
              token_log_probs=[float(x) for x in log_probs], source_tokens=self._pieces(ids[i]),
              align=[int(x) for x in weights.argmax(axis=1)])
          if attention:
            output['attention'] = weights.tolist()
    return outputs

  def _pieces(self, ids: list[int]) -> list[str]:
    return [self._sp.id_to_piece(t) for t in ids]


def output_line(translation: str) -> str:
  """A translation on one line: line breaks and tabs inside it become spaces."""
  return ' '.join(translation.replace('\t', ' ').splitlines())


