"""The joint sentencepiece BPE tokenizer of a run: trained once from a sample of the training
text (`train`), saved as WORKDIR/tokenizer.model, loaded by training, decoding and export."""

from __future__ import annotations

import hashlib
import io
import itertools
import os
from collections.abc import Sequence

import numpy as np
import sentencepiece as spm

from model.tokens import EOS_ID, PAD_ID, UNK_ID
from nmt.text_io import MissingDataError


class Tokenizer:
  """Joint sentencepiece model; ids: PAD 0, EOS 1, UNK 2, no BOS; byte fallback."""

  def __init__(self, sp: spm.SentencePieceProcessor):
    self._sp = sp
    self.vocab_size = sp.get_piece_size()
    self.fingerprint = hashlib.sha256(sp.serialized_model_proto()).hexdigest()
    # Smallest unsigned dtype that holds every id: what flat token arrays are stored in.
    self.token_dtype = np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.int32)

  def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Int32 id arrays [len_i], each ending with EOS_ID (one batched C++ call)."""
    ids = self._sp.encode(list(texts), out_type=int, add_eos=True)
    return [np.asarray(x, np.int32) for x in ids]

  def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """All texts' ids end to end [total] (token_dtype), each ending with EOS_ID; lengths [n]."""
    ids = self._sp.encode(list(texts), out_type=int, add_eos=True)
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    tokens = np.fromiter(itertools.chain.from_iterable(ids), self.token_dtype, int(lengths.sum()))
    return tokens, lengths

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
