"""The joint sentencepiece BPE tokenizer of a run: trained once from a sample of the training
text (`train`), saved as WORKDIR/tokenizer.model, loaded by training, decoding and export.

BPE-dropout (Provilkov et al., 2020; training only) runs in Python over the model's merges
(`Tokenizer.encode(..., dropout=p, rng=...)`): sentencepiece's own sampling draws from a
generator that differs between processes, so its pieces could not be reproduced on a resume.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import os
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from model.tokens import EOS_ID, PAD_ID, UNK_ID
from nmt.text_io import MissingDataError


class Tokenizer:
  """Joint sentencepiece model; ids: PAD 0, EOS 1, UNK 2, no BOS; byte fallback."""

  def __init__(self, sp: spm.SentencePieceProcessor):
    self._sp = sp
    self.vocab_size = sp.get_piece_size()
    self.fingerprint = hashlib.sha256(sp.serialized_model_proto()).hexdigest()
    self._merges: dict[str, tuple[float, int]] | None = None  # Piece -> (-score, id).

  def encode(self, texts: Sequence[str], *, dropout: float = 0.0,
             rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """Int32 id arrays [len_i], each ending with EOS_ID (one batched C++ call).

    With dropout > 0 (BPE-dropout, training only): each merge is skipped with that probability,
    drawn from `rng`, so the same texts and generator state give the same pieces anywhere.
    """
    if dropout > 0:
      return [np.asarray(self._merge(text, dropout, rng) + [EOS_ID], np.int32) for text in texts]
    ids = self._sp.encode(list(texts), out_type=int, add_eos=True)
    return [np.asarray(x, np.int32) for x in ids]

  def _merge(self, text: str, dropout: float, rng: np.random.Generator) -> list[int]:
    """The ids of one text by sentencepiece's BPE (bpe_model.cc): from single characters, the
    adjacent pair whose merged piece has the highest score (ties: leftmost) merges first; a
    candidate popped is dropped with probability `dropout`. Pieces not in the vocabulary fall
    back to their UTF-8 bytes. Models with user-defined or unused pieces are not supported."""
    if self._merges is None:
      sp = self._sp
      self._merges = {sp.id_to_piece(i): (-sp.get_score(i), i) for i in range(self.vocab_size)
                      if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))}
      self._bytes = [sp.piece_to_id(f'<0x{b:02X}>') for b in range(256)]
    merges, symbols = self._merges, list(self._sp.normalize(text))
    count = len(symbols)
    after, before = [*range(1, count), -1], list(range(-1, count - 1))
    heap = []

    def candidate(left: int, right: int) -> None:
      if left >= 0 and right >= 0:
        found = merges.get(symbols[left] + symbols[right])
        if found is not None:
          heapq.heappush(heap, (found[0], left, right, symbols[left] + symbols[right]))

    for i in range(count - 1):
      candidate(i, i + 1)
    draws, drawn = rng.random(3 * count), 0  # At most one draw per candidate.
    while heap:
      _, left, right, piece = heapq.heappop(heap)
      if not (symbols[left] and symbols[right]) or symbols[left] + symbols[right] != piece:
        continue  # A side has merged since.
      drawn += 1
      if draws[drawn - 1] < dropout:
        continue
      symbols[left], symbols[right] = piece, ''
      after[left] = after[right]
      if after[right] >= 0:
        before[after[right]] = left
      candidate(before[left], left)
      candidate(left, after[left])
    ids = []
    for piece in filter(None, symbols):
      found = merges.get(piece)
      ids += [found[1]] if found else [self._bytes[b] for b in piece.encode('utf-8')]
    return ids

  def encode_pieces(self, text: str) -> list[str]:
    """One text's pieces, as `encode` splits it (without the EOS)."""
    return self._sp.encode(text, out_type=str)

  def pieces(self) -> list[str]:
    """The vocabulary's pieces in id order."""
    return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

  def decode(self, ids) -> str:
    """One sequence [len]: stops at the first EOS, ignores PAD."""
    out = []
    for i in np.asarray(ids).reshape(-1).tolist():
      if i == EOS_ID:
        break
      if i != PAD_ID and 0 <= i < self.vocab_size:
        out.append(i)
    return self._sp.decode(out)


def load_tokenizer(path: str) -> Tokenizer:
  if not os.path.isfile(path):
    raise MissingDataError(f'{path}: tokenizer model not found.')
  return Tokenizer(spm.SentencePieceProcessor(model_file=path))


def processor(model: bytes) -> spm.SentencePieceProcessor:
  """The sentencepiece model of a .model file's bytes."""
  return spm.SentencePieceProcessor(model_proto=model)


def train(texts: Sequence[str], vocab_size: int) -> bytes:
  """A BPE model of `vocab_size` pieces trained on `texts`, as the bytes of a .model file.

  Deterministic: the texts are fed in order and trained single-threaded, and no file path ends
  up in the model's trainer spec, so the bytes depend only on the texts and settings.
  """
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts), model_writer=model, model_type='bpe',
      vocab_size=vocab_size, character_coverage=1.0, byte_fallback=True,
      pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
      # Identity normalisation keeps decode(encode(s)) == s (NFKC would rewrite text).
      normalization_rule_name='identity', remove_extra_whitespaces=False,
      input_sentence_size=0, shuffle_input_sentence=False, num_threads=1, minloglevel=2)
  return model.getvalue()


def put_first(model: bytes, ids: Iterable[int]) -> bytes:
  """The sentencepiece model `model` (the bytes of a .model file) with its pieces renumbered:
  PAD, EOS and UNK keep their ids, the pieces `ids` come next and the others after them, each
  group in its old order. A piece keeps its text, type and score, which are all BPE merges by,
  so every text splits into the same pieces as before, under their new ids."""
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(model)
  reserved = max(PAD_ID, EOS_ID, UNK_ID) + 1
  wanted = set(ids)
  rest = range(reserved, len(proto.pieces))
  order = [*range(reserved), *(i for i in rest if i in wanted),
           *(i for i in rest if i not in wanted)]
  pieces = [proto.pieces[i] for i in order]
  copies = [sentencepiece_model_pb2.ModelProto.SentencePiece() for _ in pieces]
  for copy, piece in zip(copies, pieces):
    copy.CopyFrom(piece)
  del proto.pieces[:]
  proto.pieces.extend(copies)
  return proto.SerializeToString()
