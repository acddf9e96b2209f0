"""The GPU weight layout (numpy only, runs on the CPU): planes hold exactly the file's bytes,
and the 8-bit activation rounding the GPU kernels use keeps |x - d q| <= d / 2."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from service.backends.cuda_layout import LAYOUTS, join_planes, round_activations, split_planes
from tests.blocks import ALL_TYPES, random_tensor


@pytest.mark.parametrize("name", ALL_TYPES)
def test_planes_partition_each_block(name):
    lay = LAYOUTS[name]
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    assert (lay.block_size, lay.type_size) == (bs, ts)
    covered = sorted(b for a, n in lay.planes for b in range(a, a + n))
    assert covered == list(range(ts)), "planes must cover every byte of a block exactly once"
    if lay.quantized:
        assert lay.planes[0][1] % 16 == 0, "the quant plane must allow 16-byte loads"


@pytest.mark.parametrize("name", ALL_TYPES)
def test_split_and_join_are_inverse(name):
    k = 256 if LAYOUTS[name].block_size > 1 else 40
    raw = random_tensor(name, 7, k, np.random.default_rng(1))
    planes = split_planes(raw, LAYOUTS[name])
    assert sum(p.size for p in planes) == raw.size           # no padding, no copies
    assert np.array_equal(join_planes(planes, LAYOUTS[name]), raw)


def test_round_activations_error_bound():
    x = np.random.default_rng(2).normal(0, 3, (5, 128)).astype(np.float32)
    x[1, :32] = 0.0                                           # an all-zero group
    q, d = round_activations(x)
    xh = (q.reshape(5, 4, 32) * d[..., None]).reshape(5, 128)
    assert (np.abs(x - xh) <= (d[..., None] / 2 * 1.0001).repeat(32, -1).reshape(5, 128)).all()
    assert (q[1, :32] == 0).all() and d[1, 0] == 0
    assert np.abs(q).max() == 127
