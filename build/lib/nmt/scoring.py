"""Scores of detokenized translations against references: sacreBLEU and chrF."""

from __future__ import annotations

from typing import Any

import sacrebleu


def score(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
  """sacreBLEU (cased and lowercased, 13a) and chrF of detokenized text, with signatures."""
  if len(hypotheses) != len(references):
    raise ValueError(f'{len(hypotheses)} translations but {len(references)} references.')
  bleu, bleu_lower, chrf = (sacrebleu.metrics.BLEU(), sacrebleu.metrics.BLEU(lowercase=True),
                            sacrebleu.metrics.CHRF())
  return {
      'bleu': bleu.corpus_score(hypotheses, [references]).score,
      'bleu_lowercase': bleu_lower.corpus_score(hypotheses, [references]).score,
      'chrf': chrf.corpus_score(hypotheses, [references]).score,
      'bleu_signature': str(bleu.get_signature()),
      'chrf_signature': str(chrf.get_signature()),
  }
