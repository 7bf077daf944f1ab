"""The engine's own scans and reductions (envs/sim/engine.py) against numpy's: they replace jnp.cumsum,
lax.cummax and jnp.sum on the hot path for speed, so they must give the same numbers at every length the
engine uses (slot tables of 1 to 1,024, the look-ahead's 64, the arrival batch's 16) and past the lengths
where they hand over to XLA's own."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from servetune.envs.sim import engine

LENGTHS = [1, 3, 16, 17, 64, 96, 256, 1024, 1025]


@pytest.mark.parametrize("n", LENGTHS)
def test_prefix_sums_match_numpy(n):
    rng = np.random.default_rng(n)
    for shape in [(n,), (n, 3)]:
        x = rng.integers(-50, 1000, size=shape).astype(np.int32)
        assert np.array_equal(np.asarray(engine._prefix_sums(jnp.asarray(x))), np.cumsum(x, axis=0))
        assert np.array_equal(np.asarray(engine._exclusive_cumsum(jnp.asarray(x))), np.cumsum(x, axis=0) - x)
        assert np.array_equal(np.asarray(engine._suffix_sums(jnp.asarray(x))), np.cumsum(x[::-1], axis=0)[::-1])


@pytest.mark.parametrize("n", LENGTHS)
def test_running_max_matches_numpy(n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    got = engine._blocked_scan(jnp.asarray(x), jnp.max, -jnp.inf, jax.lax.cummax)
    assert np.array_equal(np.asarray(got), np.maximum.accumulate(x))


@pytest.mark.parametrize("n", LENGTHS)
def test_reductions_match_numpy(n):
    rng = np.random.default_rng(n)
    ints = rng.integers(-50, 1000, size=(n, 2)).astype(np.int32)
    mask = rng.random(n) < 0.5
    assert np.array_equal(np.asarray(engine._sum(jnp.asarray(ints))), ints.sum(axis=0))
    assert int(engine._sum(jnp.asarray(mask))) == int(mask.sum())
    assert bool(engine._any(jnp.asarray(mask))) == bool(mask.any())
    assert bool(engine._any(jnp.zeros(n, bool))) is False
    assert int(engine._min(jnp.asarray(ints[:, 0]))) == int(ints[:, 0].min())


def test_prefix_and_stops_at_the_first_false():
    mask = np.array([True, True, False, True, False, True])
    assert engine._prefix_and(jnp.asarray(mask)).tolist() == [True, True, False, False, False, False]
    assert engine._prefix_and(jnp.ones(64, bool)).all()
    assert not engine._prefix_and(jnp.zeros(64, bool)).any()
    # Over more than one 32-entry block: the first False in the second block.
    long = np.ones(96, bool)
    long[70] = False
    assert np.flatnonzero(~np.asarray(engine._prefix_and(jnp.asarray(long))))[0] == 70


def test_gains_by_counts_a_block_every_block_size_steps():
    # A decoder whose first new block comes at step 3 has, with 4-token blocks, gained blocks at steps
    # 3, 7, 11, ...: by step t, (t - 3) // 4 + 1 of them, none before step 3 (hand-counted).
    table = np.asarray(engine._gains_by(jnp.asarray(4, jnp.int32), engine.LOOKAHEAD_STEPS))
    assert table[3, :12].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert table[0, 0] == 1 and table[5, 4] == 0


def test_ceil_div_is_integer_ceil_division_up_to_the_config_bounds():
    # Python's integer arithmetic is the truth; counts run to the config's bounds (servetune/config.py:
    # a request's tokens below 2^26 - 2^24, block sizes up to 2^24), with values next to multiples of b.
    rng = np.random.default_rng(0)
    top = 2**26 - 2**24
    for b in [1, 2, 3, 7, 16, 17, 1000, 2**20 - 3, 2**24 - 1, 2**24, *rng.integers(1, 2**24, 8)]:
        k = rng.integers(0, top // b + 1, 2000)
        a = np.clip(np.concatenate([k * b - 1, k * b, k * b + 1, rng.integers(0, top, 2000), [0, 1, top - 1]]),
                    0, top - 1)
        got = np.asarray(engine._ceil_div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32)))
        assert np.array_equal(got, -(-a // b)), b
