"""std::mt19937_64, the generator Megatron's build_mapping shuffles BERT samples with, as numpy arrays.

The 64-bit Mersenne Twister (Matsumoto and Nishimura's MT19937-64, the parameters the C++ standard gives it):
seeded as std::mt19937_64(seed) is, each block of 312 outputs one twist of the state (in three vectorized slices:
the first 156 words read only old words, the next 155 read words the first slice already replaced) and tempered.
"""

from __future__ import annotations

import numpy as np

N, M = 312, 156
MATRIX_A = np.uint64(0xB5026F5AA96619E9)
UPPER, LOWER = np.uint64(0xFFFFFFFF80000000), np.uint64(0x7FFFFFFF)


def _seed_state(seed: int) -> np.ndarray:
    state = [seed & 0xFFFFFFFFFFFFFFFF]
    for i in range(1, N):
        state.append((6364136223846793005 * (state[-1] ^ (state[-1] >> 62)) + i) & 0xFFFFFFFFFFFFFFFF)
    return np.array(state, dtype=np.uint64)


def _twist(mt: np.ndarray) -> None:
    one = np.uint64(1)

    def step(i: np.ndarray | slice, nxt, far) -> None:
        x = (mt[i] & UPPER) | (nxt & LOWER)
        mt[i] = far ^ (x >> one) ^ ((x & one) * MATRIX_A)

    step(slice(0, N - M), mt[1:N - M + 1].copy(), mt[M:N].copy())
    step(slice(N - M, N - 1), mt[N - M + 1:N].copy(), mt[0:M - 1].copy())
    step(slice(N - 1, N), mt[0:1].copy(), mt[M - 1:M].copy())


def _temper(y: np.ndarray) -> np.ndarray:
    y = y ^ ((y >> np.uint64(29)) & np.uint64(0x5555555555555555))
    y = y ^ ((y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000))
    y = y ^ ((y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000))
    return y ^ (y >> np.uint64(43))


def mt19937_64(seed: int, count: int) -> np.ndarray:
    """The first `count` outputs of std::mt19937_64(seed), uint64."""
    mt, out = _seed_state(seed), []
    for _ in range(-(-count // N)):
        _twist(mt)
        out.append(_temper(mt.copy()))
    return np.concatenate(out)[:count] if out else np.zeros(0, dtype=np.uint64)


def megatron_shuffle(rows: np.ndarray, seed: int) -> np.ndarray:
    """`rows` reordered as build_mapping shuffles its samples: for i from n - 1 down to 1, swap i with
    j = rand64() % (i + 1), rand64 = std::mt19937_64(seed)."""
    n = len(rows)
    if n < 2:
        return rows.copy()
    i = np.arange(n - 1, 0, -1, dtype=np.uint64)
    js = (mt19937_64(seed, n - 1) % (i + np.uint64(1))).astype(np.int64)
    order = np.arange(n)
    for a, b in zip(range(n - 1, 0, -1), js.tolist()):
        order[a], order[b] = order[b], order[a]
    return rows[order]
