"""Training-step throughput of train.py's real compiled step, against the matmul peak.

  python -m benchmarks.train_step [--json out.json] [--steps 10] [--repeats 3] \
      [--dtype float32|bfloat16] [--breakdown] [--attention-probs sparsemax|entmax15] \
      [--vocab 8000] [--output-vocab 0] [--d-model 256] [--d-ff 1024] [--layers 3] \
      [--batch 64] [--length 32] \
      [--attention-score dot|bilinear|additive] [--linear-attention] [--pre-norm] \
      [--norm layer|scale] [--fix-norm] [--weight-decay 0.1]

Builds the step exactly as training does (configs/multi30k.py + overrides,
`sharding.make_mesh`, `init_train_state`, `sharding.state_shardings`, `compile_train_step`,
`sharding.from_host_rows`) on the comparison shape: vocabulary 8000, d_model 256, d_ff 1024,
4 heads, 3+3 layers, dropout 0.1, label smoothing 0.1, Adam (no moving average); 64 random
rows of 32 source and 32 target tokens, no packing.

Reports target tokens/s (median over repeats of `--steps` timed steps after warm-up), seconds
per step, time to the first step (trace + compile + run), the step's FLOPs by XLA's cost
analysis and by an analytic model count, achieved GFLOP/s, a float32 2048^3 matmul peak
(benchmarks/matmul_peak.py) measured in the same run, MFU on both FLOP counts, and the speed
normalised against the Flax WMT example (2,038 target tok/s at a 204 GFLOP/s peak on this
machine type). `--breakdown` also times the step's parts (forward, forward+backward, output
layer + loss, optimizer update) as separately jitted functions.
"""

from __future__ import annotations

if __name__ == '__main__':
  from nmt import glibc_malloc  # As train.py does; TRANSFORMER_KEEP_MALLOC=1 measures without it.

  glibc_malloc.reexec_with_malloc_settings()

import argparse
import functools
import json
import os
import platform
import statistics
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.matmul_peak import matmul_peak_gflops
from configs import multi30k
from model import EOS_ID, Transformer, TransformerConfig
from nmt import config_check, optimization, sharding

# The peer: the Flax WMT example's train step on the same shape and machine type.
PEER_TOKENS_PER_S = 2038.0
PEER_GFLOP_PER_STEP = 97.0
PEER_PEAK_GFLOPS = 204.0
PEER_MFU = 0.47
GOAL_MFU = 0.70
DTYPES = ('bfloat16', 'float32')  # Compute dtypes (config.model.dtype); parameters stay float32.


# ----------------------------------------------------------------------------- setup


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--json', default='', help='Also write the results here.')
  parser.add_argument('--steps', type=int, default=10, help='Timed steps per repeat.')
  parser.add_argument('--warmup', type=int, default=2, help='Untimed steps after the first.')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--dtype', default='float32', choices=DTYPES)
  parser.add_argument('--breakdown', action='store_true', help='Also time the step\'s parts.')
  # The comparison shape; smaller values are for smoke tests.
  parser.add_argument('--vocab', type=int, default=8000)
  parser.add_argument('--output-vocab', type=int, default=0,
                      help='model.output_vocab_size: ids the output layer scores (0: all).')
  parser.add_argument('--d-model', type=int, default=256)
  parser.add_argument('--d-ff', type=int, default=1024)
  parser.add_argument('--heads', type=int, default=4)
  parser.add_argument('--layers', type=int, default=3, help='Encoder and decoder layers each.')
  parser.add_argument('--batch', type=int, default=64)
  parser.add_argument('--length', type=int, default=32)
  parser.add_argument('--dropout', type=float, default=0.1, help='0 shows what dropout costs.')
  parser.add_argument('--attention-probs', default='softmax',
                      choices=('softmax', 'sparsemax', 'entmax15'))
  parser.add_argument('--attention-score', default='scaled_dot',
                      choices=('scaled_dot', 'dot', 'bilinear', 'additive'))
  parser.add_argument('--linear-attention', action='store_true')
  parser.add_argument('--pre-norm', action='store_true', help='Pre-LN instead of post-LN.')
  parser.add_argument('--norm', default='layer', choices=('layer', 'scale'),
                      help="'scale': ScaleNorm (with --pre-norm).")
  parser.add_argument('--fix-norm', action='store_true',
                      help='FixNorm: unit-length embedding rows.')
  parser.add_argument('--weight-decay', type=float, default=0.0,
                      help="AdamW's decay of the matrices (optimizer.weight_decay); 0: Adam.")
  parser.add_argument('--peak-size', type=int, default=2048, help='Matmul size for the peak.')
  parser.add_argument('--peak-runs', type=int, default=10, help='Timed matmuls; the best counts.')
  return parser.parse_args(argv)


def make_config(args: argparse.Namespace):
  """configs/multi30k.py with the benchmark's shape."""
  config = multi30k.get_config()
  config.model.update(
      vocab_size=args.vocab, output_vocab_size=args.output_vocab, d_model=args.d_model,
      d_ff=args.d_ff, num_heads=args.heads,
      num_encoder_layers=args.layers, num_decoder_layers=args.layers, dropout_rate=args.dropout,
      attention_dropout_rate=0.0, dtype=args.dtype, attention_probs=args.attention_probs,
      attention_score=args.attention_score, linear_attention=args.linear_attention,
      pre_norm=args.pre_norm, norm=args.norm, fix_norm=args.fix_norm)
  config.model.max_len = max(config.model.max_len, args.length)
  # An output layer over the first ids is what train.py sets from the ordered tokenizer.
  config.data.update(batch_size=args.batch, max_length=args.length,
                     target_pieces_first=bool(args.output_vocab))
  # No moving average: the step compared with the Flax WMT example's is the paper's update.
  config.optimizer.update(label_smoothing=0.1, grad_accum_steps=1,
                          weight_decay=args.weight_decay, grad_clip_norm=0.0, ema_decay=0.0)
  return config


def random_batch(rows: int, length: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Unpacked rows of random ids in [3, vocab) ending with EOS; one segment per row."""
  rng = np.random.default_rng(seed)
  batch = {}
  for side in ('inputs', 'targets'):
    ids = rng.integers(3, vocab, size=(rows, length), dtype=np.int32)
    ids[:, -1] = EOS_ID
    batch[side] = ids
    batch[f'{side}_segmentation'] = np.ones((rows, length), np.int32)
    batch[f'{side}_positions'] = np.broadcast_to(
        np.arange(length, dtype=np.int32), (rows, length)).copy()
  return batch


def build(args: argparse.Namespace) -> dict:
  """Everything train.py builds for its step: model, optimizer, sharded state and batch."""
  config = make_config(args)
  mesh = sharding.make_mesh(config.mesh_shape)
  config_check.validate_config(config, mesh)
  model = Transformer(TransformerConfig(**config.model))
  optimizer = optimization.make_optimizer(config)
  init_state = functools.partial(optimization.init_train_state, model, optimizer)
  rng = jax.random.PRNGKey(config.seed)
  shardings = sharding.state_shardings(jax.eval_shape(init_state, rng), mesh)
  state = jax.jit(init_state, out_shardings=shardings)(rng)
  step_fn, batch_sharding = optimization.compile_train_step(config, model, optimizer, mesh,
                                                            shardings)
  # One process holds every row here, as the single host of a training run does.
  batch = sharding.from_host_rows(random_batch(args.batch, args.length, args.vocab),
                                  batch_sharding)
  return dict(config=config, mesh=mesh, model=model, optimizer=optimizer, state=state,
              step_fn=step_fn, batch=batch)


# ----------------------------------------------------------------------------- measurements


def time_steps(step_fn, state, batch, steps: int, warmup: int, repeats: int):
  """(first-step seconds, per-repeat seconds per step, final state); the state is donated."""
  start = time.perf_counter()
  state, metrics = step_fn(state, batch)
  jax.block_until_ready((state, metrics))
  first = time.perf_counter() - start
  for _ in range(warmup):
    state, metrics = step_fn(state, batch)
  jax.block_until_ready((state, metrics))
  per_step = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(steps):
      state, metrics = step_fn(state, batch)
    jax.block_until_ready((state, metrics))
    per_step.append((time.perf_counter() - start) / steps)
  return first, per_step, state


def xla_flops(jitted, *args) -> float:
  """FLOPs of one call by XLA's cost analysis of the compiled executable."""
  analysis = jitted.lower(*args).compile().cost_analysis()
  if isinstance(analysis, list | tuple):  # Older JAX: one dict per executable.
    analysis = analysis[0]
  return float(analysis.get('flops', 0.0))


def analytic_flops(params, model_config, batch: int, source_len: int, target_len: int) -> dict:
  """Model FLOPs of forward + backward (3x forward), matmuls only.

  6 * kernel parameters * tokens (encoder kernels see source tokens, decoder kernels target
  tokens), plus attention (QK^T and AV over every key, the causal half not skipped) and the
  output projection over the vocabulary. Embedding look-ups, norms and softmaxes are not counted.
  `model_config`: config.model (or a TransformerConfig).
  """
  src_tokens, tgt_tokens = batch * source_len, batch * target_len
  encoder = decoder = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = [getattr(p, 'key', str(p)) for p in path]
    if names[-1] != 'kernel':
      continue
    if names[0].startswith('encoder'):
      encoder += leaf.size
    else:  # Decoder layers, and the output projection when embeddings are not shared.
      decoder += leaf.size
  dense = 6 * (encoder * src_tokens + decoder * tgt_tokens)
  m = model_config
  d = m.d_model
  per_row = (m.num_encoder_layers * source_len**2
             + m.num_decoder_layers * (target_len**2 + target_len * source_len))
  attention = 12 * d * per_row * batch  # 2 matmuls x 2 FLOPs x 3 (forward + backward).
  outputs = m.output_vocab_size or m.vocab_size
  output = 6 * d * outputs * tgt_tokens if m.share_embeddings else 0
  return {'total': float(dense + attention + output), 'dense_nonembedding': float(dense),
          'attention': float(attention), 'output_projection': float(output),
          'params_nonembedding_kernels': int(encoder + decoder)}


def _best_time(fn, args, runs: int) -> float:
  jax.block_until_ready(fn(*args))
  best = float('inf')
  for _ in range(runs):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def breakdown(built: dict, runs: int) -> dict[str, dict[str, float]]:
  """Seconds (best of `runs`) and XLA FLOPs of the step's parts, each jitted on its own.

  forward: the training-mode loss (dropout on); forward_backward: its gradient; output_layer:
  logits through the shared embedding + label-smoothed loss, forward and backward, on random
  hidden states; optimizer: Adam's update and apply_updates; full_step: optimization.train_step.
  """
  config, model, optimizer = built['config'], built['model'], built['optimizer']
  state, batch = built['state'], built['batch']
  params = state['params']
  label_smoothing = config.optimizer.label_smoothing

  def loss_fn(params, batch, rng):
    return optimization.training_loss(params, batch, rng, model=model,
                               label_smoothing=label_smoothing)[0]

  def output_layer(hidden, embedding, targets):
    logits = (hidden @ embedding.T).astype(jnp.float32)
    weights = (targets > 0).astype(jnp.float32)
    return optimization.cross_entropy(logits, targets, weights, label_smoothing)['loss']

  def update(grads, opt_state, params):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  rng = jax.random.PRNGKey(1)
  embedding = params['embed']['embedding'] if 'embed' in params else None
  hidden = jax.random.normal(rng, batch['targets'].shape + (model.config.d_model,),
                             model.config.dtype)
  grads = jax.tree_util.tree_map(jnp.ones_like, params)
  parts = {
      'forward': (jax.jit(loss_fn), (params, batch, rng)),
      'forward_backward': (jax.jit(jax.grad(loss_fn)), (params, batch, rng)),
      'optimizer': (jax.jit(update), (grads, state['opt_state'], params)),
  }
  if embedding is not None:
    parts['output_layer'] = (jax.jit(jax.grad(output_layer, argnums=(0, 1))),
                             (hidden, embedding.astype(hidden.dtype), batch['targets']))
  no_donation = jax.jit(functools.partial(
      optimization.train_step, model=model, optimizer=optimizer,
      schedule=optimization.learning_rate_schedule(config), label_smoothing=label_smoothing,
      grad_accum_steps=config.optimizer.grad_accum_steps))
  parts['full_step'] = (no_donation, (state, batch))
  results = {}
  for name, (fn, args) in parts.items():
    seconds = _best_time(fn, args, runs)
    flops = xla_flops(fn, *args)
    results[name] = {'seconds': seconds, 'xla_gflop': flops / 1e9,
                     'gflops_per_s': flops / seconds / 1e9}
  return results


def machine() -> dict:
  model_name = platform.processor() or 'unknown'
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      for line in f:
        if line.startswith('model name'):
          model_name = line.split(':', 1)[1].strip()
          break
  except OSError:
    pass
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return {'cpu': model_name, 'cores': cores, 'jax': jax.__version__, 'flax': flax.__version__,
          'backend': jax.default_backend(), 'devices': jax.device_count(),
          'xla_flags': os.environ.get('XLA_FLAGS', ''),
          'glibc_tunables': os.environ.get('GLIBC_TUNABLES', '')}


# ----------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict:
  """All measurements as one JSON-able dict."""
  peak = matmul_peak_gflops(args.peak_size, args.peak_runs)
  built = build(args)
  config, step_fn, batch = built['config'], built['step_fn'], built['batch']
  params = built['state']['params']
  # Abstract state for the cost analysis: the real one is donated by the timed steps.
  abstract_state = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), built['state'])
  flops_model = analytic_flops(params, config.model, args.batch, args.length, args.length)
  num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))

  first, per_step, state = time_steps(step_fn, built['state'], batch, args.steps, args.warmup,
                                      args.repeats)
  built['state'] = state
  flops_xla = xla_flops(step_fn, abstract_state, batch)
  seconds = statistics.median(per_step)
  parts = breakdown(built, max(args.repeats, 3)) if args.breakdown else None
  peak = max(peak, matmul_peak_gflops(args.peak_size, args.peak_runs))  # Again, after the load.

  tokens = float(jnp.sum(batch['targets'] > 0))
  achieved_xla = flops_xla / seconds / 1e9
  achieved_model = flops_model['total'] / seconds / 1e9
  tokens_per_s = tokens / seconds
  # FLOP-count-free comparison: tokens/s per GFLOP/s of peak, ours over the peer's.
  normalised = (tokens_per_s / peak) / (PEER_TOKENS_PER_S / PEER_PEAK_GFLOPS)
  results = {
      'setup': dict(vocab=args.vocab, d_model=args.d_model, d_ff=args.d_ff, heads=args.heads,
                    layers=f'{args.layers}+{args.layers}', dtype=args.dtype, batch=args.batch,
                    length=args.length, dropout=config.model.dropout_rate,
                    label_smoothing=config.optimizer.label_smoothing,
                    optimizer='adamw' if config.optimizer.weight_decay else 'adam',
                    weight_decay=config.optimizer.weight_decay, params=int(num_params),
                    steps=args.steps, warmup=args.warmup, repeats=args.repeats),
      'target_tokens_per_step': tokens,
      'target_tokens_per_s': tokens_per_s,
      'seconds_per_step': seconds,
      'seconds_per_step_repeats': per_step,
      'first_step_s': first,
      'xla_gflop_per_step': flops_xla / 1e9,
      'model_gflop_per_step': flops_model['total'] / 1e9,
      'model_flops_breakdown_gflop': {k: v / 1e9 for k, v in flops_model.items()
                                      if k != 'params_nonembedding_kernels'},
      'params_nonembedding_kernels': flops_model['params_nonembedding_kernels'],
      'achieved_gflops_xla': achieved_xla,
      'achieved_gflops_model': achieved_model,
      'matmul_peak_gflops': peak,
      'mfu_xla': achieved_xla / peak,
      'mfu_model': achieved_model / peak,
      'normalised_vs_peer': {
          'peer': dict(target_tokens_per_s=PEER_TOKENS_PER_S, gflop_per_step=PEER_GFLOP_PER_STEP,
                       peak_gflops=PEER_PEAK_GFLOPS, mfu=PEER_MFU),
          'tokens_per_s_per_peak_ratio': normalised,
          'mfu_xla_ratio': achieved_xla / peak / PEER_MFU,
          'mfu_model_ratio': achieved_model / peak / PEER_MFU,
          'goal_mfu': GOAL_MFU,
          'goal_met_xla': achieved_xla / peak >= GOAL_MFU,
          'goal_met_model': achieved_model / peak >= GOAL_MFU,
      },
      'machine': machine(),
  }
  if parts is not None:
    for part in parts.values():
      part['fraction_of_step'] = part['seconds'] / parts['full_step']['seconds']
      part['mfu_xla'] = part['gflops_per_s'] / peak
    results['breakdown'] = parts
  return results


def report(results: dict) -> None:
  r = results
  print(f"setup: {r['setup']}")
  print(f"machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, "
        f"jax {r['machine']['jax']}")
  print(f"matmul peak: {r['matmul_peak_gflops']:.1f} GFLOP/s (float32 2048^3, best run)")
  print(f"train step: {r['target_tokens_per_s']:,.0f} target tok/s, "
        f"{r['seconds_per_step'] * 1e3:.1f} ms/step (repeats: "
        f"{', '.join(f'{s * 1e3:.1f}' for s in r['seconds_per_step_repeats'])} ms), "
        f"first step {r['first_step_s']:.2f} s")
  print(f"FLOPs/step: XLA {r['xla_gflop_per_step']:.1f} G, model {r['model_gflop_per_step']:.1f} G "
        f"{ {k: round(v, 2) for k, v in r['model_flops_breakdown_gflop'].items()} }")
  print(f"achieved: {r['achieved_gflops_xla']:.1f} GFLOP/s (XLA count), "
        f"{r['achieved_gflops_model']:.1f} GFLOP/s (model count); "
        f"MFU {r['mfu_xla']:.1%} (XLA) / {r['mfu_model']:.1%} (model)")
  n = r['normalised_vs_peer']
  print(f"vs the Flax WMT example (MFU {PEER_MFU:.0%}): tok/s per peak x"
        f"{n['tokens_per_s_per_peak_ratio']:.2f}, MFU x{n['mfu_xla_ratio']:.2f} (XLA) / "
        f"x{n['mfu_model_ratio']:.2f} (model); goal MFU >= {GOAL_MFU:.0%}: "
        f"{'met' if n['goal_met_xla'] else 'not met'} (XLA), "
        f"{'met' if n['goal_met_model'] else 'not met'} (model)")
  for name, part in r.get('breakdown', {}).items():
    print(f"  {name:>16}: {part['seconds'] * 1e3:7.1f} ms  {part['fraction_of_step']:6.1%} of step"
          f"  {part['xla_gflop']:6.2f} GFLOP  {part['gflops_per_s']:6.1f} GFLOP/s"
          f"  MFU {part['mfu_xla']:.1%}")


def main(argv=None) -> dict:
  args = parse_args(argv)
  results = run(args)
  report(results)
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(results, f, indent=2)
  return results


if __name__ == '__main__':
  main()
