"""Scores of detokenized translations against references: sacreBLEU (cased and lowercased,
13a) and chrF; with the target language, also the BLEU the multimodal-MT literature reports
on Multi30k, which is not sacreBLEU (`tokenized_lowercase`)."""

from __future__ import annotations

import functools
from typing import Any

import sacrebleu
from sacremoses import MosesPunctNormalizer, MosesTokenizer

# How decode.py names the tokenized metric, so that no one takes it for sacreBLEU.
TOK_LC_NAME = "BLEU tok-lc (Multi30k papers' metric: lowercased, Moses-tokenized; not sacreBLEU)"


@functools.cache
def _moses(lang: str) -> tuple[MosesPunctNormalizer, MosesTokenizer]:
  return MosesPunctNormalizer(lang), MosesTokenizer(lang)


def tokenized_lowercase(texts: list[str], lang: str) -> list[str]:
  """Texts as the Multi30k repository's `*.lc.norm.tok.*` files hold them: lowercased, then
  Moses' punctuation normalisation, then Moses' tokenizer (no escaping), tokens joined by
  spaces."""
  normalizer, tokenizer = _moses(lang)
  return [' '.join(tokenizer.tokenize(normalizer.normalize(text.lower()), escape=False))
          for text in texts]


def score(hypotheses: list[str], references: list[str],
          lang: str | None = None) -> dict[str, Any]:
  """sacreBLEU (cased and lowercased, 13a) and chrF of detokenized text, with signatures; with
  the target language `lang`, also 'bleu_tok_lc': BLEU of `tokenized_lowercase` text with
  sacreBLEU's own tokenization off."""
  if len(hypotheses) != len(references):
    raise ValueError(f'{len(hypotheses)} translations but {len(references)} references.')
  bleu, bleu_lower, chrf = (sacrebleu.metrics.BLEU(), sacrebleu.metrics.BLEU(lowercase=True),
                            sacrebleu.metrics.CHRF())
  scores = {
      'bleu': bleu.corpus_score(hypotheses, [references]).score,
      'bleu_lowercase': bleu_lower.corpus_score(hypotheses, [references]).score,
      'chrf': chrf.corpus_score(hypotheses, [references]).score,
      'bleu_signature': str(bleu.get_signature()),
      'chrf_signature': str(chrf.get_signature()),
  }
  if lang:
    tokenized = sacrebleu.metrics.BLEU(tokenize='none', force=True)  # Tokenized on purpose.
    scores['bleu_tok_lc'] = tokenized.corpus_score(
        tokenized_lowercase(hypotheses, lang), [tokenized_lowercase(references, lang)]).score
  return scores
