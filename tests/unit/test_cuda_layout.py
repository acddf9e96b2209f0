"""The GPU weight layout (numpy only, runs on the CPU): planes hold exactly the file's bytes,
and the 8-bit activation rounding the GPU kernels use keeps |x - d q| <= d / 2."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from service.backends.act_quant import round_activations
from service.backends.cuda.layout import (
    LAYOUTS,
    join_planes,
    plane_offsets,
    split_planes,
    write_planes,
)
from tests.support.blocks import ALL_TYPES, random_tensor


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


@pytest.mark.parametrize("name", ALL_TYPES)
def test_write_planes_in_ranges_equals_split_planes(name):
    """The staging writer, called on consecutive block ranges as the pinned upload does (two
    ranges packed into one buffer after an odd start), puts exactly split_planes' bytes in
    each plane segment, 16-byte aligned, and writes nothing between the segments."""
    lay = LAYOUTS[name]
    k = 512 if lay.block_size > 1 else 48
    raw = random_tensor(name, 5, k, np.random.default_rng(3))
    n_blocks = raw.size // lay.type_size
    want = split_planes(raw, lay)
    got: list[list[np.ndarray]] = [[] for _ in lay.planes]
    buf = np.full(2 * raw.size + 256, 0xAB, np.uint8)
    at, written = 7, 0
    for b0, b1 in ((0, n_blocks // 3), (n_blocks // 3, n_blocks)):
        offs, end = plane_offsets(lay, b1 - b0, at)
        assert all(o % 16 == 0 for o in offs) and end <= buf.size
        write_planes(raw, lay, b0, b1, buf, offs)
        for p, ((_, n), o) in enumerate(zip(lay.planes, offs, strict=True)):
            got[p].append(buf[o:o + (b1 - b0) * n].copy())
        written += sum((b1 - b0) * n for _, n in lay.planes)
        at = end
    for p in range(len(lay.planes)):
        assert np.array_equal(np.concatenate(got[p]), want[p]), (name, p)
    assert int((buf != 0xAB).sum()) <= written    # nothing outside the segments


def test_round_activations_error_bound():
    x = np.random.default_rng(2).normal(0, 3, (5, 128)).astype(np.float32)
    x[1, :32] = 0.0                                           # an all-zero group
    q, d = round_activations(x)
    xh = (q.reshape(5, 4, 32) * d[..., None]).reshape(5, 128)
    assert (np.abs(x - xh) <= (d[..., None] / 2 * 1.0001).repeat(32, -1).reshape(5, 128)).all()
    assert (q[1, :32] == 0).all() and d[1, 0] == 0
    assert np.abs(q).max() == 127
