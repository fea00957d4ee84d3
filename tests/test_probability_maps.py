"""Tests of model/probability_maps.py: sparsemax and 1.5-entmax against a float64 bisection
for their threshold, closed forms, finite-difference derivatives, and masking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.probability_maps import entmax15, sparsemax

MAPS = {'sparsemax': sparsemax, 'entmax15': entmax15}
NEGATIVE = np.finfo(np.float32).min  # What MultiHeadAttention writes at masked keys.


def reference(name: str, z: np.ndarray) -> np.ndarray:
  """The map by bisection on tau in float64: sum_j f(z_j - tau) = 1, f increasing in z."""
  z = np.asarray(z, np.float64)
  if name == 'sparsemax':
    f = lambda t: np.maximum(z - t, 0)
  else:
    f = lambda t: np.maximum(z / 2 - t, 0) ** 2
  low = np.min(z, axis=-1, keepdims=True) - 2  # Sum > 1 here ...
  high = np.max(z, axis=-1, keepdims=True)     # ... and 0 here.
  for _ in range(200):
    middle = (low + high) / 2
    too_low = f(middle).sum(-1, keepdims=True) > 1
    low, high = np.where(too_low, middle, low), np.where(too_low, high, middle)
  return f((low + high) / 2)


def sparsemax_by_projection(z: np.ndarray) -> np.ndarray:
  """The Euclidean projection onto the simplex, by trying every support: the feasible
  candidate max(z - tau_S, 0) nearest to z."""
  n = len(z)
  best, best_distance = None, np.inf
  for bits in range(1, 2**n):
    support = np.array([(bits >> i) & 1 for i in range(n)], bool)
    tau = (z[support].sum() - 1) / support.sum()
    p = np.where(support, z - tau, 0)
    if np.all(p >= 0) and np.sum((p - z) ** 2) < best_distance:
      best, best_distance = p, np.sum((p - z) ** 2)
  return best


@pytest.mark.parametrize('name', list(MAPS))
def test_equals_float64_bisection_on_random_rows(name):
  rng = np.random.default_rng(0)
  z = rng.normal(size=(64, 9)) * rng.choice([0.1, 1.0, 5.0], size=(64, 1))
  got = np.asarray(MAPS[name](jnp.asarray(z, jnp.float32)))
  np.testing.assert_allclose(got, reference(name, z), atol=2e-6)
  np.testing.assert_allclose(got.sum(-1), 1, atol=1e-6)
  assert (got == 0).any(axis=-1).mean() > 0.5  # Sparse: most rows have exact zeros.


def test_sparsemax_is_the_projection_onto_the_simplex():
  rng = np.random.default_rng(1)
  for z in rng.normal(size=(20, 6)) * 1.5:
    np.testing.assert_allclose(np.asarray(sparsemax(jnp.asarray(z, jnp.float32))),
                               sparsemax_by_projection(z), atol=1e-6)


def test_closed_forms():
  # Two scores: sparsemax([t, 0]) = [clip((t + 1) / 2, 0, 1), rest].
  for t in (-3.0, -0.4, 0.0, 0.7, 2.5):
    first = min(max((t + 1) / 2, 0), 1)
    np.testing.assert_allclose(sparsemax(jnp.array([t, 0.0])), [first, 1 - first], atol=1e-7)
  # 1.5-entmax([t, 0]) with both in the support: p1 = (t/2 - tau)^2, p2 = tau^2, sum 1.
  t = 1.0
  tau = (t / 2 - np.sqrt(2 - t**2 / 4)) / 2
  np.testing.assert_allclose(entmax15(jnp.array([t, 0.0])), [(t / 2 - tau) ** 2, tau**2],
                             atol=1e-6)
  for fn in MAPS.values():
    np.testing.assert_allclose(fn(jnp.full((5,), 3.0)), np.full(5, 0.2), atol=1e-7)
    np.testing.assert_array_equal(fn(jnp.array([0.0, -10.0, -3.0])), [1.0, 0.0, 0.0])


@pytest.mark.parametrize('name', list(MAPS))
def test_masked_scores_get_exactly_zero_and_fully_masked_rows_do_not_break(name):
  rng = np.random.default_rng(2)
  z = rng.normal(size=(4, 7)).astype(np.float32)
  mask = rng.random((4, 7)) < 0.6
  mask[:, 0] = True
  mask[3] = False  # A row with every key masked.
  masked = np.where(mask, z, NEGATIVE)
  got = np.asarray(MAPS[name](jnp.asarray(masked)))
  assert np.all(got[:3][~mask[:3]] == 0)
  np.testing.assert_allclose(got[:3].sum(-1), 1, atol=1e-6)
  for row in range(3):  # The unmasked scores alone give the same.
    np.testing.assert_allclose(got[row][mask[row]], reference(name, z[row][mask[row]]),
                               atol=2e-6)
  assert np.all(np.isfinite(got[3])) and np.allclose(got[3], 1 / 7)
  weights = rng.normal(size=(4, 7)).astype(np.float32)
  grads = jax.grad(lambda s: jnp.sum(MAPS[name](s) * weights))(jnp.asarray(masked))
  assert np.all(np.isfinite(np.asarray(grads)))


@pytest.mark.parametrize('name', list(MAPS))
def test_derivatives_match_finite_differences(name):
  rng = np.random.default_rng(3)
  z = rng.normal(size=(6, 8)) * 2
  direction = rng.normal(size=z.shape)
  weights = rng.normal(size=z.shape)
  with jax.enable_x64(True):
    fn = MAPS[name]
    loss = lambda s: jnp.sum(fn(s).astype(jnp.float64) * weights)
    # The maps compute in float32; finite differences of a float64 reference instead.
    reference_loss = lambda s: np.sum(reference(name, s) * weights)
    eps = 1e-5
    numeric = (reference_loss(z + eps * direction) - reference_loss(z - eps * direction)) / (
        2 * eps)
    grad = np.asarray(jax.grad(loss)(jnp.asarray(z, jnp.float32)), np.float64)
    np.testing.assert_allclose(np.sum(grad * direction), numeric, rtol=1e-4, atol=1e-4)
    # Forward mode agrees with reverse mode.
    _, tangent = jax.jvp(lambda s: fn(s), (jnp.asarray(z, jnp.float32),),
                         (jnp.asarray(direction, jnp.float32),))
    np.testing.assert_allclose(np.sum(np.asarray(tangent, np.float64) * weights), numeric,
                               rtol=1e-4, atol=1e-4)
