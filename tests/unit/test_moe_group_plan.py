"""The launch choices of the expert-grouped MoE GEMVs (service/backends/cuda/types.py): the tile
width for a step and the bound on moe_group's tile count that sizes the GEMVs' grid.y (a bound
below a real count would leave pairs without output)."""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.cuda.types import MOEG_NC, moe_group_nc, moe_group_tiles


def tiles_of(ids: np.ndarray, n_expert: int, nc: int) -> int:
    """What moe_group makes: per expert ceil(count / nc) tiles."""
    counts = np.bincount(ids, minlength=n_expert)
    return int(sum(-(-c // nc) for c in counts))


def routings(T: int, n_used: int, n_expert: int, rng):
    """Each token's n_used distinct experts: uniform, skewed to few experts, and one expert per
    token apart from a shared hot set."""
    uniform = np.stack([rng.choice(n_expert, n_used, replace=False) for _ in range(T)])
    hot = np.stack([np.r_[np.arange(n_used - 1), n_used - 1 + rng.integers(0, 2)]
                    for _ in range(T)])
    spread = np.stack([np.r_[np.arange(n_used - 1), n_used - 1 + t % (n_expert - n_used + 1)]
                       for t in range(T)])
    return [r.reshape(-1) for r in (uniform, hot, spread)]


@pytest.mark.parametrize("n_expert,n_used", [(128, 8), (16, 4), (256, 8), (8, 2)])
def test_the_tile_bound_holds_for_every_routing_and_width(n_expert, n_used):
    rng = np.random.default_rng(n_expert)
    for T in (1, 2, 7, 16, 33, 64, 512):
        for ids in routings(T, n_used, n_expert, rng):
            for nc in MOEG_NC:
                bound = moe_group_tiles(ids.size, n_expert, nc)
                assert tiles_of(ids, n_expert, nc) <= bound <= ids.size, (T, nc)


def test_the_tile_bound_is_reached():
    # every pair its own expert: one tile per pair at any width
    assert moe_group_tiles(8, 128, 16) == 8 == tiles_of(np.arange(8), 128, 16)
    # 128 experts, one with 385 rows and 127 with 1: ceil(385 / 8) + 127 = (512 + 128 * 7) / 8
    ids = np.r_[np.zeros(385, int), np.arange(1, 128)]
    assert tiles_of(ids, 128, 8) == 49 + 127 == 176
    assert moe_group_tiles(512, 128, 8) == 176


def test_the_tile_width_follows_the_rows_per_expert():
    assert moe_group_nc(1, 8, 128) == 1
    assert [moe_group_nc(T, 8, 128) for T in (2, 6, 8, 16, 33, 64, 512)] == [1, 1, 1, 1, 4, 4, 8]
    for T in (1, 2, 3, 5, 9, 17, 100):
        for n_used, n_exp in ((8, 128), (2, 8), (4, 16), (8, 256)):
            nc = moe_group_nc(T, n_used, n_exp)
            assert nc in MOEG_NC and nc // 2 < T, (T, nc)     # never twice the rows needed
