"""nmt/scoring.py: sacreBLEU and chrF as sacrebleu computes them, and the Multi30k papers'
tokenized lowercase BLEU against text tokenized by hand."""

import os

import pytest
import sacrebleu

from nmt import scoring

MULTI30K = os.environ.get('MULTI30K_DIR', '')

HYPOTHESES = ['Ein Mann, der „Hallo“ sagt.', 'Zwei Hunde spielen im Schnee.',
              'Eine Frau (in Rot) läuft 3,5 km - schnell!']
REFERENCES = ['Ein Mann sagt „Hallo“.', 'Zwei Hunde spielen draußen im Schnee.',
              'Eine Frau in Rot läuft schnell!']
# Lowercased, German quotes normalised to ", punctuation split off, numbers kept whole.
HYPOTHESES_BY_HAND = ['ein mann , der " hallo " sagt .', 'zwei hunde spielen im schnee .',
                      'eine frau ( in rot ) läuft 3,5 km - schnell !']
REFERENCES_BY_HAND = ['ein mann sagt " hallo " .', 'zwei hunde spielen draußen im schnee .',
                      'eine frau in rot läuft schnell !']


def test_tokenized_lowercase_matches_hand_tokenized_text():
  assert scoring.tokenized_lowercase(HYPOTHESES, 'de') == HYPOTHESES_BY_HAND
  assert scoring.tokenized_lowercase(REFERENCES, 'de') == REFERENCES_BY_HAND


def test_scores_are_sacrebleu_and_the_tokenized_bleu_scores_the_tokens():
  scores = scoring.score(HYPOTHESES, REFERENCES, 'de')
  assert scores['bleu'] == sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score
  assert scores['bleu_lowercase'] == sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES],
                                                           lowercase=True).score
  assert scores['chrf'] == sacrebleu.corpus_chrf(HYPOTHESES, [REFERENCES]).score
  by_hand = sacrebleu.corpus_bleu(HYPOTHESES_BY_HAND, [REFERENCES_BY_HAND], tokenize='none')
  assert scores['bleu_tok_lc'] == pytest.approx(by_hand.score)
  # Another metric than sacreBLEU's on the same text: the two must not be mistaken.
  assert scores['bleu_tok_lc'] != scores['bleu_lowercase']
  assert 'bleu_tok_lc' not in scoring.score(HYPOTHESES, REFERENCES)
  with pytest.raises(ValueError, match='3 translations but 2 references'):
    scoring.score(HYPOTHESES, REFERENCES[:2])


def test_the_tokenized_bleu_says_nothing_of_its_tokens(caplog):
  """Before: every decode.py run with references logged sacreBLEU's 'It looks like you forgot
  to detokenize your test data' about the tokens the papers' metric makes on purpose."""
  with caplog.at_level('WARNING'):
    scores = scoring.score(HYPOTHESES * 60, REFERENCES * 60, 'de')  # 120 lines end in ' .'
  assert scores['bleu_tok_lc'] > 0 and not caplog.records, caplog.text


def test_tokenized_test_2016_references_hold_the_published_token_count():
  """The published test_2016_flickr.lc.norm.tok.de holds 12,103 tokens."""
  path = os.path.join(MULTI30K, 'test_2016_flickr.de')
  if not os.path.isfile(path):
    pytest.skip('needs the Multi30k files: set MULTI30K_DIR (../shared/data/multi30k on these '
                'machines)')
  with open(path, encoding='utf-8') as f:
    references = [line.rstrip('\n') for line in f]
  tokens = scoring.tokenized_lowercase(references, 'de')
  assert len(references) == 1000 and sum(len(t.split()) for t in tokens) == 12103
