"""The CUDA sample op (cuda/sampling.cu) against the CPU reference (backends/cpu/sampling.py)
on identical logits: the same token ids for every row of a grid of parameters, log-probabilities
within 1e-5 (both compute them in float64 and store float32; only the order of the sums
differs, about 1e-16 relative), and the token history the penalty reads."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from service.backends.cpu import sampling as ref
from service.backends.step_format import OUT_WORDS, TOP_MAX, Param, param_record

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu
ROWS = 16
N_CTX = 96


def random_logits(rng, L: int, V: int, ties: bool) -> np.ndarray:
    x = rng.standard_normal((L, V)).astype(np.float32) * np.float32(3.0)
    if ties:                        # logits on a coarse grid: long runs of equal values
        x = np.round(x * 2) / 2
    return x


def run_both(cuda, logits: np.ndarray, records: list[list[int]], hist: np.ndarray,
             adj: np.ndarray | None = None):
    L, V = logits.shape
    params = np.array(records, np.int32)                                  # (L, N_PARAMS)
    adj = np.zeros((1, 2), np.int32) if adj is None else adj              # (K, 2) i32
    want = np.zeros((L, OUT_WORDS), np.int32)
    ref.sample_rows(logits, params, hist, adj, want)
    cuda.prepare_sampling(ROWS, V)
    out = cuda.zeros((L, OUT_WORDS), "int32")
    out.fill(-7)                                                          # poisoned
    cuda.sample(cp.asarray(logits), cp.asarray(params), cp.asarray(hist), cp.asarray(adj), out)
    return cuda.to_host(out), want


def assert_same(got: np.ndarray, want: np.ndarray, records) -> None:
    for r, rec in enumerate(records):
        assert got[r, 0] == want[r, 0], (r, rec)
        n_top = rec[Param.N_TOP]
        if n_top < 0:
            continue
        g, w = got[r].view(np.float32), want[r].view(np.float32)
        assert abs(g[1] - w[1]) <= 1e-5, (r, rec)
        assert np.array_equal(got[r, 2:2 + TOP_MAX], want[r, 2:2 + TOP_MAX]), (r, rec)
        np.testing.assert_allclose(g[2 + TOP_MAX:], w[2 + TOP_MAX:], atol=1e-5, rtol=0)


GRID = list(itertools.product(
    [0.0, 0.6, 1.0, 1.7],                 # temperature
    [0, 1, 40, 700, 2000],                # top_k (2000: more than the 1024 compacted)
    [1.0, 0.9, 0.3],                      # top_p
    [0.0, 0.05],                          # min_p
    [1.0, 1.3],                           # repetition penalty
))


@pytest.mark.parametrize("V", [1000, 49152, 262144])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_sample_matches_cpu_over_the_grid(cuda, V, ties):
    rng = np.random.default_rng(V + ties)
    hist = rng.integers(0, V, (3, N_CTX)).astype(np.int32)               # (slots, n_ctx)
    grid = GRID if V < 262144 else GRID[::3]
    for b0 in range(0, len(grid), ROWS):
        chunk = grid[b0:b0 + ROWS]
        logits = random_logits(rng, len(chunk), V, ties)
        records = [param_record(temperature=t, top_k=k, top_p=p, min_p=m, penalty=r,
                                repeat_last_n=int(rng.integers(0, 80)), seed=int(rng.integers(
                                    0, 2**63)) * 2 + 1, token_index=int(rng.integers(0, 5000)),
                                n_top=[-1, 0, 5, TOP_MAX][i % 4], slot=i % 3,
                                position=int(rng.integers(0, N_CTX)))
                   for i, (t, k, p, m, r) in enumerate(chunk)]
        got, want = run_both(cuda, logits, records, hist)
        assert_same(got, want, records)


def test_draws_follow_the_counter_uniform(cuda):
    """2,000 plain draws (no filter) over 8 tokens: any difference in the uniform (seed and
    index words, splitmix64 in uint64) or in the inverse CDF shows up as a different id."""
    rng = np.random.default_rng(5)
    V = 8
    hist = np.zeros((1, 4), np.int32)
    for b in range(125):
        logits = random_logits(rng, ROWS, V, False) * np.float32(0.3)
        records = [param_record(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0,
                                repeat_last_n=0, seed=int(rng.integers(0, 2**64, dtype=np.uint64)),
                                token_index=b * ROWS + i, n_top=-1, slot=0, position=0)
                   for i in range(ROWS)]
        got, want = run_both(cuda, logits, records, hist)
        assert got[:, 0].tolist() == want[:, 0].tolist()


def test_greedy_ties_and_logprob_order(cuda):
    V = 5000
    x = np.zeros((2, V), np.float32)
    x[0, [17, 5, 900]] = 4.0                  # greedy: the lowest id of the tie
    x[1, [3, 2, 1]] = [1.0, 2.0, 2.0]         # top log-probs: 1, 2 (tie, lower id first), 3
    records = [param_record(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0,
                            repeat_last_n=0, seed=0, token_index=0, n_top=3, slot=0,
                            position=0)] * 2
    got, want = run_both(cuda, x, records, np.zeros((1, 1), np.int32))
    assert got[0, 0] == 5 and got[1, 0] == 1
    assert got[1, 2:5].tolist() == [1, 2, 3]
    assert_same(got, want, records)


def test_record_tokens_skips_padding_rows(cuda):
    hist = cp.zeros((3, 16), cp.int32)
    ids = cp.asarray(np.array([0, 0, 11, 12, 13], np.int32))
    slots = cp.asarray(np.array([-1, -1, 2, 2, 0], np.int32))
    pos = cp.asarray(np.array([0, 0, 4, 5, 9], np.int32))
    cuda.record_tokens(ids, slots, pos, hist)
    want = np.zeros((3, 16), np.int32)
    want[2, 4], want[2, 5], want[0, 9] = 11, 12, 13
    assert np.array_equal(cuda.to_host(hist), want)


def test_chosen_ids_copies_word_0_of_each_record(cuda):
    """chosen_ids on the CUDA backend equals the CPU op: word 0 of every output record (row
    views included, as a draft chain passes them), nothing else of out written."""
    from service.backends.cpu.backend import CpuBackend

    rng = np.random.default_rng(3)
    records = rng.integers(-5, 50000, (6, OUT_WORDS), dtype=np.int32)   # (6, OUT_WORDS) i32
    want = np.full(8, -7, np.int32)
    CpuBackend().chosen_ids(records[1:5], want[2:6])
    dev = cp.asarray(records)
    out = cp.full((8,), -7, cp.int32)                                   # poisoned
    cuda.chosen_ids(dev[1:5], out[2:6])
    cuda.chosen_ids(dev[5:6], out[7:8])
    want[7] = records[5, 0]
    assert np.array_equal(cuda.to_host(out), want)
    assert np.array_equal(want[2:6], records[1:5, 0])


def test_step_io_round_trip(cuda):
    host = cuda.host_buffer(100)
    host[:] = np.arange(100, dtype=np.int32) * 3
    dev = cuda.zeros((128,), "int32")
    cuda.upload_step(host, dev)
    back = cuda.host_buffer(100)
    cuda.download_step(dev[:100], back)
    assert np.array_equal(back, host)



@pytest.mark.parametrize("V", [1000, 49152])
def test_penalties_and_adjustments_match_cpu(cuda, V):
    """Frequency / presence penalties over hist[slot, gen_start .. pos] (repeats in the window,
    with and without the repetition penalty), sparse adjustment pairs (biases, -inf bans, rows
    sharing one range, rows with none) and scored ids (a prompt token's log-probability): the
    same ids and log-probabilities as the CPU op, and the counts scratch left zero (a second
    launch gives the same choices)."""
    rng = np.random.default_rng(V)
    hist = rng.integers(0, 40, (3, N_CTX)).astype(np.int32)        # many repeats per window
    ids = np.sort(rng.choice(V, 300, replace=False)).astype(np.int32)
    deltas = rng.uniform(-100, 100, 300).astype(np.float32)
    deltas[::7] = -np.inf
    adj = np.stack([ids, deltas.view(np.int32)], axis=1)                # (300, 2) i32
    records = []
    for i in range(ROWS):
        pos = int(rng.integers(0, N_CTX))
        records.append(param_record(
            temperature=[0.0, 0.8][i % 2], top_k=[0, 40][i % 3 == 0], top_p=0.95, min_p=0.0,
            penalty=[1.0, 1.3][i % 4 == 1], repeat_last_n=16, seed=1000 + i, token_index=i,
            n_top=[-1, 5][i % 2], slot=i % 3, position=pos,
            frequency=float(rng.uniform(-2, 2)) if i % 5 else 0.0,
            presence=float(rng.uniform(-2, 2)) if i % 3 else 0.0,
            gen_start=int(rng.integers(0, pos + 2)),
            adj_start=[0, 0, 100, 250][i % 4], adj_count=[0, 300, 150, 50][i % 4],
            score=int(rng.integers(0, V)) if i % 4 == 3 else -1))
    for _ in range(2):
        got, want = run_both(cuda, random_logits(rng, ROWS, V, False), records, hist, adj)
        assert_same(got, want, records)
