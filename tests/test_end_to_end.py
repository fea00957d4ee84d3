"""End to end on real Multi30k text: train, average checkpoints (or take the moving average),
translate, score with sacreBLEU.

Both are marked slow (the small model trains for minutes, the other runs the README's
default recipe); the fast set's learning claim is the copy task in tests/test_train.py.
Each asserts a BLEU floor that an untrained or broken model (wrong masks, shuffled outputs,
lost order) cannot reach: such a model scores below 1.
"""

import os

import pytest

import input_pipeline
import train
from configs import multi30k, tiny
from nmt import checkpoints, runs, scoring, sharding
from nmt import translator as translator_lib

MULTI30K = os.environ.get('MULTI30K_DIR', '')
pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(MULTI30K, 'train.en')),
    reason='needs the Multi30k files: set MULTI30K_DIR (../shared/data/multi30k on these machines)')


def train_translate_score(config, workdir, num_sentences):
  result = train.train_and_evaluate(config, workdir)
  assert result['step'] == config.num_train_steps
  which = 'ema' if config.optimizer.ema_decay else 'averaged'  # What the recipe decodes.
  if which == 'averaged':
    checkpoints.save_averaged(workdir, config.average_last_checkpoints)
  run_config, tokenizer, model = runs.load_run(workdir)
  translator = translator_lib.Translator(model, tokenizer, run_config.decode, sharding.make_mesh())
  params, _ = runs.load_params(workdir, translator.mesh, which)
  sources, references = input_pipeline.read_split(run_config, run_config.data.test_split)
  hypotheses = translator(params, sources[:num_sentences])
  assert len(hypotheses) == num_sentences
  return scoring.score(hypotheses, references[:num_sentences]), result


@pytest.mark.slow
def test_small_model_learns_to_translate(tmp_path):
  config = tiny.get_config()
  config.model.vocab_size = 2000
  config.data.spm_sample_size = 20000
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.d_ff = 256
  config.model.num_encoder_layers = 2
  config.model.num_decoder_layers = 2
  config.data.batch_size = 32
  config.data.max_length = 48
  config.num_train_steps = 600
  config.optimizer.warmup_steps = 200
  config.optimizer.learning_rate_scale = 1.0
  config.checkpoint_every_steps = 100
  config.average_last_checkpoints = 3
  config.eval.every_steps = 300
  config.eval.bleu_sentences = 0
  config.log_every_steps = 100
  scores, result = train_translate_score(config, str(tmp_path), 200)
  print('small model:', scores, result['metrics'])
  assert scores['bleu'] > FAST_BLEU_FLOOR, scores
  assert scores['chrf'] > FAST_CHRF_FLOOR, scores


@pytest.mark.slow
def test_default_recipe_reaches_its_documented_score(tmp_path):
  """The README's main job: its documented score is in BENCHMARKS.md."""
  scores, _ = train_translate_score(multi30k.get_config(), str(tmp_path), 1000)
  print('default recipe:', scores)
  assert scores['bleu'] > SLOW_BLEU_FLOOR, scores


# The small model's scores are in BENCHMARKS.md; an untrained one scores below 1.
FAST_BLEU_FLOOR = 8.0
FAST_CHRF_FLOOR = 25.0
# The default recipe's test_2016_flickr score is the README's; the floor leaves room for the
# rounding of other machines.
SLOW_BLEU_FLOOR = 35.0
