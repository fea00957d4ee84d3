"""The HTTP server's batcher: one thread that owns the exported translator and translates the
requests of many threads together, in the slot pool (continuous batching across requests, CPU
exports) or in batches.

It lives in `nmt/` in a checkout; `export.py` copies it flat into the exported folder, beside
`serving.py`, so it imports only the standard library, jax, numpy and `serving_translator`.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

if __package__:  # nmt/ in a checkout
  from nmt.serving_translator import ExportedTranslator, batch_rows
else:  # flat in an exported folder
  from serving_translator import ExportedTranslator, batch_rows


class Busy(Exception):
  """The translation queue is full: the request is refused (503), not queued."""


# The slot pool's state as a whole, each operation one compiled program per shape (one
# operation per leaf, dispatched one by one, stalled the server for seconds at a new size).
@jax.jit
def _concatenate_slots(state: Any, extra: Any) -> Any:
  """The slots of `state`, then those of `extra` (a new, larger state: nothing to donate)."""
  return jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), state, extra)


@jax.jit
def _take_slots(state: Any, index: jax.Array) -> Any:
  """The slots `index` [n] of `state`, in that order."""
  return jax.tree_util.tree_map(lambda x: x[index], state)


class SlotPool:
  """The exported slot pool (`model/cpu/slot_pool.py`), driven from the host: sentences join the
  running search as soon as a slot is free and leave it as soon as they end, so a sentence
  never waits for a batch's slowest one (continuous batching across requests).

  The pool holds as many slots as its running and waiting sentences need, a size of the
  export's `sizes` (grown at once, shrunk once it is four times too big); each size's step
  program compiles on first use. Not thread-safe: the `Batcher` thread alone drives it.
  """

  def __init__(self, translator: ExportedTranslator, steps: int = 2):
    self.translator = translator
    settings = translator.manifest['pool']
    self.width, self.sizes = settings['width'], settings['sizes']
    self.start_widths = settings['start_widths']  # Encoder widths of admissions, ascending.
    self.steps = steps  # Search steps per call between admissions.
    self.owners: list[Any] = []  # Per slot: what its sentence belongs to, or None (free).
    self.state: Any = None
    self.admissions = 0  # Calls of the admit program, and sentences admitted.
    self.admitted = 0

  @property
  def running(self) -> int:
    return sum(owner is not None for owner in self.owners)

  @property
  def capacity(self) -> int:
    return self.sizes[-1]

  def fits(self, tokens: list[int]) -> bool:
    return len(tokens) <= self.width

  def _resize(self, needed: int) -> None:
    """Grows the pool to hold `needed` sentences, or shrinks it when it is four times too big;
    running slots keep their state."""
    size = len(self.owners)
    target = next((n for n in self.sizes if n >= needed), self.sizes[-1])
    if target > size:
      extra = self.translator._call_tree('pool_init', np.zeros((target - size,), np.int32))
      self.state = extra if self.state is None else _concatenate_slots(self.state, extra)
      self.owners += [None] * (target - size)
    elif target * 4 <= size:
      keep = [i for i, owner in enumerate(self.owners) if owner is not None]
      keep += [i for i, owner in enumerate(self.owners) if owner is None][:target - len(keep)]
      self.state = _take_slots(self.state, jnp.asarray(np.array(keep, np.int32)))
      self.owners = [self.owners[i] for i in keep]

  def admit(self, items: list[tuple[Any, list[int]]], waiting: int = 0) -> None:
    """Sentences (owner, token ids ending in EOS) into free slots; the pool first grows to
    hold them and `waiting` more. They are encoded together, in the narrowest start width that
    holds the longest."""
    self._resize(self.running + len(items) + waiting)
    free = [i for i, owner in enumerate(self.owners) if owner is None][:len(items)]
    if len(free) < len(items):
      raise ValueError(f'{len(items)} sentences for {len(free)} free slots')
    rows = batch_rows(len(items))
    longest = max(len(tokens) for _, tokens in items)
    width = next(w for w in self.start_widths if w >= longest)
    sources = np.full((rows, width), self.translator.pad_id, np.int32)
    slots = np.full((rows,), len(self.owners), np.int32)  # Out of range: no slot.
    for row, ((owner, tokens), slot) in enumerate(zip(items, free)):
      sources[row, :len(tokens)] = tokens
      slots[row] = slot
      self.owners[slot] = owner
    started = self.translator._call_tree(f'pool_start_{width}', sources)
    self.state = self.translator._call_tree(f'pool_put_{len(self.owners)}', self.state, started,
                                            slots)
    self.admissions += 1
    self.admitted += len(items)

  def warm_up(self) -> None:
    """Compiles what the pool can run (every size's step, starts of 1, 2, 4, ... sentences
    in each start width and putting them into each size, growing and shrinking it from each
    size to each other), so that no request waits for a compile."""
    init = lambda size: self.translator._call_tree('pool_init', np.zeros((size,), np.int32))
    for size in self.sizes:
      state = init(size)
      for rows in (1 << i for i in range(size.bit_length())):
        for width in self.start_widths:
          started = self.translator._call_tree(
              f'pool_start_{width}', np.full((rows, width), self.translator.pad_id, np.int32))
        state = self.translator._call_tree(f'pool_put_{size}', state, started,
                                           np.arange(rows, dtype=np.int32))
      state = self.translator._call_tree(f'pool_step_{size}', state, np.int32(1))
      for other in self.sizes:
        if other > size:
          _concatenate_slots(init(size), init(other - size))
        elif other * 4 <= size:
          _take_slots(state, jnp.arange(other, dtype=jnp.int32))

  def step(self) -> list[tuple[Any, str]]:
    """Up to `steps` search steps; the sentences that ended, with their translations."""
    size = len(self.owners)
    self.state = self.translator._call_tree(f'pool_step_{size}', self.state,
                                            np.int32(self.steps))
    done = np.asarray(self.state['done'])
    ended = [i for i, owner in enumerate(self.owners) if owner is not None and done[i]]
    if not ended:
      return []
    sequences = np.asarray(self.state['fin_seqs'][:, 0])
    results = []
    for i in ended:
      results.append((self.owners[i], self.translator._text(sequences[i])))
      self.owners[i] = None
    return results


class Job:
  """One request's sentences waiting for the batcher, then its results."""

  def __init__(self, texts: list[str], ids: list[list[int]], details: bool, nbest: int,
               attention: bool):
    self.texts, self.ids = texts, ids
    self.tokens = sum(len(x) for text, x in zip(texts, ids) if text.strip())
    self.details, self.nbest, self.attention = details, nbest, attention
    self.result: list[Any] | None = None
    self.error: BaseException | None = None
    self.remaining = 0  # Its sentences still in the slot pool.
    self.done = threading.Event()


class Batcher:
  """Translates the requests of many threads together, one search at a time.

  Its thread owns the translator: a request thread queues a `Job` (`submit`) and waits on it.
  With a slot pool (CPU exports; `pool`), the sentences of plain requests join the pool's
  running search as soon as a slot is free and leave it as soon as they end: a request that
  arrives while others translate starts at the next call of the pool, whatever stage theirs
  are at. Requests the pool does not take (details, n-best or attention, sentences longer than
  its width, more sentences than it holds) and every request without a pool are translated in
  batches: the batcher takes every job queued while its last batch translated, oldest first,
  up to `batch_sentences` sentences and `batch_tokens` source tokens (the oldest job is always
  taken, whatever its size), translates them with as few searches as their lengths allow, and
  hands each job its own results in its own order. A lone request is translated at once.
  """

  def __init__(self, translator: ExportedTranslator, batch_sentences: int = 128,
               batch_tokens: int | None = None, max_queued_sentences: int = 4096,
               pool: bool = True, pool_steps: int = 2):
    self.translator = translator
    self.batch_sentences = batch_sentences
    self.batch_tokens = batch_tokens or translator.batch_tokens
    self.max_queued_sentences = max_queued_sentences
    self.pool = SlotPool(translator, pool_steps) if pool and translator.has_pool else None
    self._waiting: list[tuple[Job, int]] = []  # Sentences waiting for a slot of the pool.
    self._queue: list[Job] = []
    self._queued_sentences = 0
    self._condition = threading.Condition()
    self._stopping = False
    self.batches = 0  # Batches (and pool calls) run, and the sentences translated.
    self.sentences = 0
    self._thread = threading.Thread(target=self._run, name='batcher', daemon=True)
    self._thread.start()

  def submit(self, texts: list[str], details: bool = False, nbest: int = 1,
             attention: bool = False) -> Job:
    """Queues `texts` for the next batch; raises Busy when the queue holds too many."""
    job = Job(texts, self.translator.encode(texts), details, nbest, attention)
    with self._condition:
      if self._stopping:
        raise Busy('the server is shutting down')
      if self._queue and self._queued_sentences + len(texts) > self.max_queued_sentences:
        raise Busy(f'{self._queued_sentences} sentences are waiting to be translated')
      self._queue.append(job)
      self._queued_sentences += len(texts)
      self._condition.notify()
    return job

  @property
  def queued_sentences(self) -> int:
    """Sentences queued or waiting for a slot, not yet being translated."""
    return self._queued_sentences + len(self._waiting)

  def stop(self) -> None:
    """Translates what is queued, then ends the batcher's thread."""
    with self._condition:
      self._stopping = True
      self._condition.notify()
    self._thread.join()

  def _take(self, wait: bool) -> list[Job] | None:
    """The next batch's jobs (waiting for one if `wait`); None once stopping with nothing
    queued."""
    with self._condition:
      while not self._queue:
        if self._stopping and wait:
          return None
        if not wait:
          return []
        self._condition.wait()
      jobs, sentences, tokens = [], 0, 0
      for job in self._queue:
        if jobs and (sentences + len(job.texts) > self.batch_sentences or
                     tokens + job.tokens > self.batch_tokens):
          break
        jobs.append(job)
        sentences += len(job.texts)
        tokens += job.tokens
      del self._queue[:len(jobs)]
      self._queued_sentences -= sentences
      return jobs

  def _pooled(self, job: Job) -> bool:
    return (self.pool is not None and not job.details and len(job.texts) <= self.pool.capacity
            and all(self.pool.fits(x) for x in job.ids))

  def _run(self) -> None:
    busy = lambda: self.pool is not None and (self.pool.running or self._waiting)
    while (jobs := self._take(wait=not busy())) is not None:
      batch = [job for job in jobs if not self._pooled(job)]
      if batch:
        self._finish(batch, self._translate)
      for job in jobs:
        if job in batch:
          continue
        job.result = [''] * len(job.texts)
        self._waiting += [(job, i) for i, text in enumerate(job.texts) if text.strip()]
        job.remaining = sum(1 for text in job.texts if text.strip())
        if not job.remaining:
          job.done.set()
      if busy():
        try:
          self._pool_call()
        except Exception as error:  # Its requests fail (500); the pool starts afresh.
          self._pool_failed(error)

  def _finish(self, jobs: list[Job], translate: Any) -> None:
    try:
      translate(jobs)
    except Exception as error:  # The requests fail (500); the server goes on.
      for job in jobs:
        job.error = error
    self.batches += 1
    self.sentences += sum(len(job.texts) for job in jobs)
    for job in jobs:
      job.done.set()

  def _pool_call(self) -> None:
    """Admits waiting sentences into free slots, runs the pool's steps, hands out the
    translations of the sentences that ended."""
    pool = self.pool
    free = max(0, pool.capacity - pool.running)
    if self._waiting and free:
      admitted, self._waiting = self._waiting[:free], self._waiting[free:]
      pool.admit([((job, i), job.ids[i]) for job, i in admitted], waiting=len(self._waiting))
    for (job, i), text in pool.step():
      job.result[i] = text
      job.remaining -= 1
      self.sentences += 1
      if not job.remaining:
        job.done.set()
    self.batches += 1

  def _pool_failed(self, error: BaseException) -> None:
    jobs = {id(owner[0]): owner[0] for owner in self.pool.owners if owner is not None}
    jobs.update({id(job): job for job, _ in self._waiting})
    self.pool = SlotPool(self.translator, self.pool.steps)
    self._waiting = []
    for job in jobs.values():
      job.error = error
      job.done.set()

  def _translate(self, jobs: list[Job]) -> None:
    """Each job's results: translations, or with `details` its translations' dicts."""
    translator = self.translator
    plain = [job for job in jobs if not job.details]
    if plain:
      translations = iter(translator.translate([t for job in plain for t in job.texts]))
      for job in plain:
        job.result = [next(translations) for _ in job.texts]
    # Details: the n-best search for the jobs asking more than one translation, the plain
    # one for the others; the attention matrices only where asked for.
    for wide in (False, True):
      group = [job for job in jobs if job.details and (job.nbest > 1) == wide]
      if not group:
        continue
      details = iter(translator.translate_details(
          [t for job in group for t in job.texts], translator.beam_size if wide else 1,
          attention=any(job.attention for job in group)))
      for job in group:
        job.result = []
        for _ in job.texts:
          outputs = next(details)[:job.nbest]
          if not job.attention:
            for output in outputs:
              output.pop('attention', None)
          job.result.append(outputs)


