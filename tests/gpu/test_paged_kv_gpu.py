"""The paged KV cache on the CUDA backend: a permuted block table, a pool of exactly the blocks
in use, and a new table under already captured graphs give the ids and logits of the identity
table bit for bit; paged CUDA logits stay within the CPU reference's bound (test_models.py's:
float32 summation order only, median relative error <= 1%)."""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from tests.engine.test_paged_kv import (
    N_SLOTS,
    build,
    exact_table,
    permuted_table,
    scenario,
)
from tests.support.logits import relative_errors

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def cuda_paged(graphs: bool, kv_blocks: int, block_size: int):
    from service.backends.cuda.backend import CudaBackend

    # every matmul on the GEMV (the CPU mirrors its rounding; see test_models.py)
    return build(CudaBackend(graphs=graphs, prefill_gemm_min_tokens=None), kv_blocks,
                 block_size)


def same_bits(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and np.array_equal(g.view(np.uint32), w.view(np.uint32)), i


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("block_size", [8, 16])
def test_any_block_table_gives_the_same_bits_on_cuda(graphs, block_size):
    rng = np.random.default_rng(100 + block_size)
    tr, runner = cuda_paged(graphs, 0, block_size)
    to_host = tr.backend.to_host
    mb = tr.cache.max_blocks
    assert cp.asnumpy(tr.cache.block_table).tolist() == \
        np.arange(N_SLOTS * mb).reshape(N_SLOTS, mb).tolist()
    want = scenario(tr, runner, to_host)
    # the same model and captured graphs, a new table: the kernels read it by pointer
    runner.set_block_table(permuted_table(rng, N_SLOTS * mb, mb))
    same_bits(scenario(tr, runner, to_host), want)
    # a fresh model on a permuted full pool, and on a pool of exactly the blocks used
    n_exact, t_exact = exact_table(rng, mb, block_size)
    for n_blocks, table in ((0, permuted_table(rng, N_SLOTS * mb, mb)), (n_exact, t_exact)):
        tr2, runner2 = cuda_paged(graphs, n_blocks, block_size)
        runner2.set_block_table(table)
        table[...] = 0                               # the caller's array may change at once
        same_bits(scenario(tr2, runner2, tr2.backend.to_host), want)


def test_paged_cuda_logits_match_the_paged_cpu():
    """Fixed input ids (no feedback of chosen ids, which near ties could make differ), the
    same permuted table on both backends."""
    rng = np.random.default_rng(7)
    g_tr, g_runner = cuda_paged(True, 0, 16)
    c_tr, c_runner = build(CpuBackend(threads=1, act_quant="gpu"), 0, 16)
    mb = g_tr.cache.max_blocks
    table = permuted_table(rng, N_SLOTS * mb, mb)
    g_runner.set_block_table(table)
    c_runner.set_block_table(table)
    got = scenario(g_tr, g_runner, g_tr.backend.to_host, feed=False)
    want = scenario(c_tr, c_runner, np.asarray, feed=False)
    for i in range(1, len(got), 2):                  # the logits of each step
        rel = relative_errors(got[i], want[i])
        assert np.median(rel) <= 0.01, (i, rel)
