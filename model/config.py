"""`TransformerConfig`: every architectural choice of the Transformer, validated on creation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import probability_maps
from model.tokens import EOS_ID

Array = jax.Array
# Maps attention logits [..., keys] to attention weights; 'softmax' is the paper's, the others
# give exact zeros (model/probability_maps.py).
ATTENTION_PROBS: dict[str, Callable[[Array], Array]] = {
    'softmax': jax.nn.softmax, 'sparsemax': probability_maps.sparsemax,
    'entmax15': probability_maps.entmax15}
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {'relu': nn.relu, 'gelu': nn.gelu}
# How a query and a key give an attention logit (`MultiHeadAttention.scores`).
ATTENTION_SCORES = ('scaled_dot', 'dot', 'bilinear', 'additive')


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Every architectural choice of the model.

  Defaults are the paper's base model; `base()` and `big()` give Table 3's rows. Every field
  can come from JSON: `dtype`/`param_dtype` also take names such as 'bfloat16'.
  """

  vocab_size: int
  # The output layer scores ids [0, output_vocab_size) only (0: every id): with a joint
  # vocabulary ordered target pieces first, the pieces no target holds cost no logits.
  output_vocab_size: int = 0
  d_model: int = 512
  num_heads: int = 8
  d_ff: int = 2048
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  # LayerDrop (Fan et al. 2020): in training, each encoder and decoder layer passes its input
  # on unchanged with this probability, drawn once per layer and step; inference runs them all.
  layer_drop_rate: float = 0.0
  max_len: int = 256  # Longest sequence (per segment) the positional encoding covers.
  share_embeddings: bool = True  # Source, target and output projection share one matrix.
  pre_norm: bool = False  # False: the paper's post-LN; True: LayerNorm before each sub-layer.
  # 'layer' (LayerNorm, the paper) or 'scale': ScaleNorm, g * x / ||x|| with one learned g
  # (Nguyen & Salazar 2019, "Transformers without Tears"; they pair it with pre_norm).
  norm: str = 'layer'
  # FixNorm (Nguyen & Chiang 2018; with ScaleNorm and pre_norm in Nguyen & Salazar 2019): every
  # row of the shared embedding scaled to unit length wherever it is used, so the logits are
  # the decoder output's dot products with unit vectors. Needs share_embeddings.
  fix_norm: bool = False
  positional: str = 'sinusoidal'  # 'sinusoidal' (the paper) or 'learned'.
  activation: str = 'relu'
  attention_probs: str = 'softmax'  # A key of ATTENTION_PROBS.
  # One of ATTENTION_SCORES: 'scaled_dot' q.k/sqrt(head_dim) (the paper), 'dot' q.k, 'bilinear'
  # q^T W k, 'additive' v^T tanh(q + k) (Bahdanau's, on the projected q and k: memory grows
  # as batch * heads * q_len * k_len * head_dim).
  attention_score: str = 'scaled_dot'
  # Linear attention (model/linear_attention.py) in every attention instead of a probability
  # map of scores; decoding then keeps a constant-size state instead of a growing cache.
  linear_attention: bool = False
  layer_norm_epsilon: float = 1e-6
  dtype: Any = jnp.float32  # Compute dtype, e.g. jnp.bfloat16 or 'bfloat16'.
  param_dtype: Any = jnp.float32
  # CPU-tuned primitives (same parameters): None = on when jax.default_backend() is 'cpu'.
  cpu_tuned: bool | None = None
  # `jax.nn.dot_product_attention(implementation=...)`: None or 'xla' (XLA's own lowering,
  # every backend), 'cudnn' (cuDNN's fused kernel, GPU, bf16/fp16 only).
  attention_implementation: str | None = None

  def __post_init__(self):
    for name in ('dtype', 'param_dtype'):  # 'bfloat16' and jnp.bfloat16 alike.
      object.__setattr__(self, name, jnp.dtype(getattr(self, name)))
    for name in ('vocab_size', 'd_model', 'num_heads', 'd_ff', 'num_encoder_layers',
                 'num_decoder_layers', 'max_len'):
      if getattr(self, name) < 1:
        raise ValueError(f'{name} must be positive, got {getattr(self, name)}.')
    for name in ('dropout_rate', 'attention_dropout_rate'):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f'{name} must be in [0, 1), got {getattr(self, name)}.')
    if self.attention_implementation not in (None, 'xla', 'cudnn'):
      raise ValueError("attention_implementation must be None, 'xla' or 'cudnn', got "
                       f'{self.attention_implementation!r}.')
    if self.attention_implementation == 'cudnn' and self.dtype not in (jnp.bfloat16,
                                                                        jnp.float16):
      raise ValueError("attention_implementation='cudnn' needs dtype bfloat16 or float16, got "
                       f'{self.dtype}.')
    if not 0 <= self.output_vocab_size <= self.vocab_size:
      raise ValueError(f'output_vocab_size must be in [0, vocab_size={self.vocab_size}] (0: '
                       f'every id), got {self.output_vocab_size}.')
    if 0 < self.output_vocab_size <= EOS_ID:
      raise ValueError(f'output_vocab_size={self.output_vocab_size} leaves out EOS (id {EOS_ID}).')
    if not 0 <= self.layer_drop_rate < 1:
      raise ValueError(f'layer_drop_rate must be in [0, 1), got {self.layer_drop_rate}.')
    if self.d_model % self.num_heads:
      raise ValueError(f'd_model={self.d_model} is not divisible by num_heads={self.num_heads}.')
    if self.norm not in ('layer', 'scale'):
      raise ValueError(f"norm must be 'layer' or 'scale', got {self.norm!r}.")
    if self.fix_norm and not self.share_embeddings:
      raise ValueError('fix_norm normalises the shared embedding matrix: it needs '
                       'share_embeddings=True.')
    if self.positional not in ('sinusoidal', 'learned'):
      raise ValueError(f"positional must be 'sinusoidal' or 'learned', got {self.positional!r}.")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f'activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}.')
    if self.attention_probs not in ATTENTION_PROBS:
      raise ValueError(
          f'attention_probs must be one of {sorted(ATTENTION_PROBS)}, '
          f'got {self.attention_probs!r}.')
    if self.attention_score not in ATTENTION_SCORES:
      raise ValueError(f'attention_score must be one of {list(ATTENTION_SCORES)}, '
                       f'got {self.attention_score!r}.')
    if self.linear_attention and (self.attention_probs, self.attention_score) != (
        'softmax', 'scaled_dot'):
      raise ValueError('linear_attention replaces the attention scores and probabilities: leave '
                       "attention_probs='softmax' and attention_score='scaled_dot' with it.")
    if self.linear_attention and self.attention_dropout_rate:
      raise ValueError('linear_attention has no attention weights to drop out: set '
                       'attention_dropout_rate=0.')
    if self.positional == 'sinusoidal' and self.d_model % 2:
      raise ValueError(f'sinusoidal positions need an even d_model, got {self.d_model}.')

  @classmethod
  def base(cls, vocab_size: int, **overrides) -> TransformerConfig:
    """The paper's base model (Table 3): 512/2048/8 heads/6+6 layers/dropout 0.1."""
    return cls(vocab_size=vocab_size, **overrides)

  @classmethod
  def big(cls, vocab_size: int, **overrides) -> TransformerConfig:
    """The paper's big model (Table 3): 1024/4096/16 heads/6+6 layers/dropout 0.3."""
    settings = dict(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
    return cls(vocab_size=vocab_size, **{**settings, **overrides})

  @property
  def num_outputs(self) -> int:
    """How many ids the output layer scores: the first `num_outputs` of the vocabulary."""
    return self.output_vocab_size or self.vocab_size

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def use_cpu_tuned(self) -> bool:
    """`cpu_tuned`, with None resolved against the backend (at trace time)."""
    if self.cpu_tuned is None:
      return jax.default_backend() == 'cpu'
    return self.cpu_tuned

  @property
  def use_cpu_decoding(self) -> bool:
    """Decoding with model/cpu/decoding.py's cache (softmax-family attention only)."""
    return self.use_cpu_tuned and not self.linear_attention
