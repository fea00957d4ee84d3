"""Runs written by earlier versions (nmt/legacy.py), the Translator's compiled search, scores."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model as model_lib
from configs import multi30k
from nmt import legacy, runs, sharding
from nmt import translator as translator_lib

# A tiny run (20k parameters, 10 steps) written by the code before configs had groups: its
# flat config.json, tokenizer, checkpoint, the logits its model gave for one sentence pair and
# its beam-search translations of three sentences.
LEGACY_RUN = pathlib.Path(__file__).parent / 'data' / 'legacy_run'
LEGACY_SOURCES = ['A man rides a bike down the street.', 'Two dogs play in the snow.',
                  'A woman is reading a book in a park.']


def test_flat_config_of_an_older_run_maps_to_the_groups():
  saved = json.loads((LEGACY_RUN / 'config.json').read_text(encoding='utf-8'))
  assert 'model' not in saved and 'model_max_len' in saved
  config = legacy.upgrade_config(saved)
  assert config.model.max_len == saved['model_max_len'] == 128
  assert config.model.vocab_size == saved['vocab_size']
  assert config.data.max_length == saved['max_length']
  assert config.decode.max_length == saved['max_decode_length']
  assert config.decode.alpha == saved['length_penalty_alpha']
  assert config.eval.bleu_sentences == saved['num_eval_bleu_sentences']
  assert config.optimizer.learning_rate_scale == saved['learning_rate_scale']
  # Fields the old config did not have take the model's defaults; decoding gets the settings
  # it ran with.
  assert model_lib.make_model(config.model).config.activation == 'relu'
  assert config.decode.stopping == 'exact' and config.decode.min_length == 1
  with pytest.raises(ValueError, match='no_such_key'):
    legacy.upgrade_config({**saved, 'no_such_key': 1})


def test_an_older_run_gives_the_same_logits_and_translations():
  config, tokenizer, model = runs.load_run(str(LEGACY_RUN))
  mesh = sharding.make_mesh()
  params, origin = runs.load_params(str(LEGACY_RUN), mesh)
  assert origin == 'step 10'
  expected = np.load(LEGACY_RUN / 'legacy_logits.npz')
  logits = model.apply({'params': params}, jnp.asarray(expected['inputs']),
                       jnp.asarray(expected['targets']))
  np.testing.assert_allclose(logits, expected['logits'], atol=1e-5, rtol=1e-5)
  translator = translator_lib.Translator(model, tokenizer, config.decode, mesh)
  hypotheses = (LEGACY_RUN / 'legacy_hyp.txt').read_text(encoding='utf-8').split('\n')[:-1]
  assert translator(params, LEGACY_SOURCES) == hypotheses


def test_translator_compiles_once_per_length_bucket_and_checks_nbest():
  config = multi30k.get_config()
  config.model.update(vocab_size=400, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                      num_decoder_layers=1)
  transformer = model_lib.Transformer(model_lib.TransformerConfig(**config.model))
  _, tokenizer, _ = runs.load_run(str(LEGACY_RUN))  # Any 400-piece tokenizer.
  dummy = jnp.ones((1, 4), jnp.int32)
  params = transformer.init(jax.random.key(0), dummy, dummy)['params']
  translator = translator_lib.Translator(transformer, tokenizer, config.decode,
                                      sharding.make_mesh(), batch_tokens=16)
  params = jax.device_put(params, sharding.replicated(sharding.make_mesh()))
  sources = ['A dog.', 'Two men are walking along a long sandy beach at sunset today.', '']
  first = translator(params, sources)
  compiles = translator.compiles
  assert compiles == 2 and first[2] == ''  # Two length buckets; the empty line stays empty.
  assert translator(params, sources) == first and translator.compiles == compiles
  # A call interrupted at its first batch drops the compiles it queued (not waited for at exit)
  # and leaves no cancelled program behind: the next call with new shapes compiles them.
  longer = sources + ['One ' + 'very ' * 20 + 'long sentence.', 'Yet ' + 'more ' * 40 + '.']
  original_collect = translator._collect
  def interrupt(*args):
    raise KeyboardInterrupt
  translator._collect = interrupt
  with pytest.raises(KeyboardInterrupt):
    translator(params, longer)
  translator._collect = original_collect
  assert all(not future.cancelled() for future in translator._programs.values())
  assert translator(params, longer)[:3] == first
  with pytest.raises(ValueError, match='nbest'):
    translator_lib.Translator(transformer, tokenizer, config.decode, sharding.make_mesh(), nbest=5)


def test_continuous_batching_translates_as_the_batch_search(monkeypatch):
  """More sentences than slots on one CPU device: the Translator decodes them with continuous
  batching (one search for the lot), with the batch search's translations and nbest lists."""
  monkeypatch.setattr(translator_lib, 'CONTINUOUS_SLOTS', 4)
  monkeypatch.setattr(translator_lib, 'CONTINUOUS_REFILL', 2)
  config, tokenizer, model = runs.load_run(str(LEGACY_RUN))
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  params, _ = runs.load_params(str(LEGACY_RUN), mesh)
  sources = LEGACY_SOURCES * 3 + ['', 'A dog runs.', 'Two men are walking along a beach.']
  results = {}
  for continuous in (True, False):
    translator = translator_lib.Translator(model, tokenizer, config.decode, mesh, nbest=2)
    assert translator._continuous  # One CPU device, no ensemble, prefixes or details.
    translator._continuous = continuous
    results[continuous] = translator(params, sources)
    assert translator.compiles == (1 if continuous else len(translator._programs))
  assert results[True] == results[False]
  assert len({t[0] for t in results[True]}) > 3
  assert results[True][len(LEGACY_SOURCES) * 3] == ['', '']  # The empty line.


def test_continuous_queues_take_every_sentence_once_longest_first_within_the_budget(
    monkeypatch):
  monkeypatch.setattr(translator_lib, 'CONTINUOUS_SLOTS', 4)
  monkeypatch.setattr(translator_lib, 'CONTINUOUS_QUEUE_TOKENS', 64)
  rng = np.random.default_rng(0)
  sources = [rng.integers(3, 50, size=n).astype(np.int32) for n in rng.integers(1, 20, 30)]
  queues = translator_lib.continuous_queues(sources)
  taken = np.concatenate([indices for indices, _ in queues])
  assert sorted(taken.tolist()) == list(range(30)) and len(queues) > 1
  lengths = [len(sources[i]) for i in taken]
  assert lengths == sorted(lengths, reverse=True)
  for indices, queue in queues:
    size, width = queue.shape
    assert size & (size - 1) == 0 and size >= 4 and size >= len(indices)
    assert size * width <= 64 or size == 4  # The budget, or the fewest slots.
    assert width % 8 == 0 and width - 8 < len(sources[indices[0]]) <= width
    for row, i in enumerate(indices):  # A sentence per row, then padding.
      np.testing.assert_array_equal(queue[row, :len(sources[i])], sources[i])
      assert not queue[row, len(sources[i]):].any()
    assert not queue[len(indices):].any()
