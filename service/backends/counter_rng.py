"""The counter-based random generator every backend samples with.

One uniform number per (request seed, token index), computed from the two integers alone: a
seeded request draws the same numbers whether it runs alone, in a batch, after a preemption, on
the CPU or on the GPU (cuda/sampling.cu implements the same function bit for bit).

    mix(z)  = splitmix64 finalizer: z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
                                   z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31
    r       = mix(mix(seed) + 0x9E3779B97F4A7C15 * (index + 1))          (mod 2^64)
    u       = (r >> 40) * 2^-24                                           in [0, 1)

u has 24 significant bits, so it is exact in float32 and float64 alike.
"""

from __future__ import annotations

import numpy as np

_M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def mix64(z: int) -> int:
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def counter_uniform(seed: int, index: int) -> float:
    """The uniform in [0, 1) for token `index` (0-based, counting generated tokens) of a
    request seeded `seed` (any integer; taken mod 2^64)."""
    r = mix64((mix64(seed) + GOLDEN * (index + 1)) & _M64)
    return (r >> 40) * 2.0**-24


def counter_uniforms(seeds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Vectorized counter_uniform: seeds (n,) uint64, indices (n,) int -> (n,) float64."""
    with np.errstate(over="ignore"):
        s = np.asarray(seeds, np.uint64)

        def mix(z):
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            return z ^ (z >> np.uint64(31))

        idx = np.asarray(indices).astype(np.uint64) + np.uint64(1)
        r = mix(mix(s) + np.uint64(GOLDEN) * idx)
    return (r >> np.uint64(40)).astype(np.float64) * 2.0**-24
