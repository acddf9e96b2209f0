"""The paged KV cache on the CPU backend: any valid block table (the identity, a random
permutation of the full pool, or a pool holding exactly the blocks in use) gives the same bits
for prefill chunks, decode steps, sliding-window layers, a tree step with attn_lo / attn_mask
and kv_move; set_block_table refuses invalid tables."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from service.engine.runner import GREEDY, ModelRunner, StepInput
from service.engine.spec.draft_model import ModelDrafter
from service.model.spec import ModelSpec
from service.model.transformer import Transformer
from tests.support.models import build_model

N_SLOTS, N_CTX, MAX_TOKENS, WINDOW = 3, 64, 32, 8


def sliding_spec(spec: ModelSpec) -> ModelSpec:
    """The model with a sliding window of WINDOW keys on its even layers."""
    layers = tuple(dataclasses.replace(la, window=WINDOW if i % 2 == 0 else 0)
                   for i, la in enumerate(spec.layers))
    return dataclasses.replace(spec, layers=layers)


def build(backend, kv_blocks: int, block_size: int) -> tuple[Transformer, ModelRunner]:
    tr = build_model("tiny-qwen3", backend, n_ctx=N_CTX, n_slots=N_SLOTS, max_tokens=MAX_TOKENS,
                     spec=sliding_spec, max_logits=16, kv_blocks=kv_blocks,
                     block_size=block_size)
    return tr, ModelRunner(tr, N_SLOTS, N_CTX)


def _step(ids, positions, slots, n_logits, **tree) -> StepInput:
    n = len(ids)
    return StepInput(list(ids), list(positions), list(slots), range(n - n_logits, n),
                     [GREEDY] * n_logits, **tree)


# logical positions each slot uses in `scenario` (slot 2 stays empty)
USED = {0: 14, 1: 29}


def scenario(tr: Transformer, runner: ModelRunner, to_host, feed: bool = True
             ) -> list[np.ndarray]:
    """Chosen ids and logits of: a 20-token prefill chunk (masked path) in slot 1, a 10-token
    prompt in slot 0, decode steps of both slots past the window, a tree step in slot 1 with
    its compaction (kv_move), and a decode step reading the moved row. Every row read is
    written earlier in the scenario, so it may run again on a used cache. feed: each step
    takes the ids the previous one chose (else fixed ids, for comparing two backends)."""
    V = tr.spec.vocab_size
    out: list[np.ndarray] = []

    def run(inp: StepInput) -> np.ndarray:
        res = runner.step(inp)
        out.append(res.token_ids.copy())
        out.append(to_host(tr.ws_logits[:len(inp.logit_rows)]).copy())
        return res.token_ids

    def pick(chosen, fixed: int) -> int:
        return int(chosen) if feed else fixed % V

    a = run(_step([(11 * i + 5) % V for i in range(20)], range(20), [1] * 20, 3))
    b = run(_step([(7 * i + 3) % V for i in range(10)], range(10), [0] * 10, 1))
    nxt = {0: pick(b[-1], 31), 1: pick(a[-1], 37)}
    pos = {0: 10, 1: 20}
    for i in range(4):                              # decode both slots (mixed step)
        ids = run(_step([nxt[0], nxt[1]], [pos[0], pos[1]], [0, 1], 2))
        nxt = {0: pick(ids[0], 41 + i), 1: pick(ids[1], 43 + i)}
        pos = {0: pos[0] + 1, 1: pos[1] + 1}
    c = pos[1]                                      # slot 1 has c committed rows
    # tree: node 0 (depth 0), nodes 1 and 2 its children (depth 1); KV rows c, c+1, c+2
    ids = run(_step([nxt[1], 17, 23], [c, c + 1, c + 1], [1, 1, 1], 3,
                    kv_positions=[c, c + 1, c + 2], attn_lo=[c, c, c],
                    attn_mask=[0b1, 0b11, 0b101]))
    runner.move_kv([1], [c + 2], [c + 1])           # accept node 2: its row moves to c + 1
    run(_step([pick(ids[2], 53), nxt[0]], [c + 2, pos[0]], [1, 0], 2))
    return out


def permuted_table(rng, n_blocks: int, max_blocks: int) -> np.ndarray:
    return rng.permutation(n_blocks).astype(np.int32)[:N_SLOTS * max_blocks].reshape(
        N_SLOTS, max_blocks)


def exact_table(rng, max_blocks: int, block_size: int) -> tuple[int, np.ndarray]:
    """(n_blocks, table) of a pool holding exactly the blocks `scenario` uses, in random
    order; the unused entries point at random (valid) blocks and are never touched."""
    need = {s: -(-(last + 1) // block_size) for s, last in USED.items()}
    n_blocks = sum(need.values())
    ids = iter(rng.permutation(n_blocks).tolist())
    table = rng.integers(0, n_blocks, (N_SLOTS, max_blocks)).astype(np.int32)
    for s, n in need.items():
        for b in range(n):
            table[s, b] = next(ids)
    return n_blocks, table


def logical_rows(tr: Transformer, slot: int, n: int) -> list[np.ndarray]:
    rows = tr.cache.rows(slot, np.arange(n))
    return [a[rows] for a in (*tr.cache.k, *tr.cache.v)]


@pytest.mark.parametrize("block_size", [8, 16])
def test_any_block_table_gives_the_same_bits(block_size):
    rng = np.random.default_rng(block_size)
    ref_tr, ref_runner = build(CpuBackend(threads=1), 0, block_size)
    max_blocks = ref_tr.cache.max_blocks
    assert max_blocks == N_CTX // block_size
    assert np.array_equal(ref_tr.cache.block_table,            # the identity
                          np.arange(N_SLOTS * max_blocks).reshape(N_SLOTS, max_blocks))
    want = scenario(ref_tr, ref_runner, np.asarray)

    full = N_SLOTS * max_blocks
    n_exact, t_exact = exact_table(rng, max_blocks, block_size)
    for n_blocks, table in ((0, permuted_table(rng, full, max_blocks)), (n_exact, t_exact)):
        tr, runner = build(CpuBackend(threads=1), n_blocks, block_size)
        assert tr.cache.n_blocks == (n_blocks or full)
        assert len(tr.cache.k[0]) == tr.cache.n_blocks * block_size
        runner.set_block_table(table)
        got = scenario(tr, runner, np.asarray)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert np.array_equal(g, w), (n_blocks, i)
        # the rows went where the table says: same logical rows, other physical places
        for s, last in USED.items():
            for g, w in zip(logical_rows(tr, s, last + 1), logical_rows(ref_tr, s, last + 1),
                            strict=True):
                assert np.array_equal(g, w), (n_blocks, s)
        if n_blocks == 0:
            assert not np.array_equal(tr.cache.k[0], ref_tr.cache.k[0])
    # the reference cache again, under a new table: its old rows are all rewritten first
    ref_runner.set_block_table(permuted_table(rng, full, max_blocks))
    again = scenario(ref_tr, ref_runner, np.asarray)
    assert all(np.array_equal(g, w) for g, w in zip(again, want, strict=True))


def test_a_small_pool_starts_with_block_zero_everywhere():
    be = CpuBackend(threads=1)
    cache = be.new_kv_cache(1, 3, 60, 1, 32, 32, "f16", "f16", n_blocks=5, block_size=16)
    assert (cache.max_blocks, cache.n_blocks, cache.block_size) == (4, 5, 16)
    assert cache.block_table.shape == (3, 4) and cache.block_table.dtype == np.int32
    assert not cache.block_table.any()
    assert cache.k[0].shape == (80, 1, 32)


@pytest.mark.parametrize("block_size", [4, 12, 512])
def test_block_size_must_be_a_power_of_two_in_8_to_256(block_size):
    with pytest.raises(ValueError, match="block size"):
        CpuBackend(threads=1).new_kv_cache(1, 1, 64, 1, 32, 32, "f16", "f16",
                                           block_size=block_size)


def test_set_block_table_validates():
    be = CpuBackend(threads=1)
    cache = be.new_kv_cache(1, 2, 64, 1, 32, 32, "f16", "f16", n_blocks=6, block_size=16)
    good = np.array([[0, 1, 2, 3], [5, 4, 0, 1]], np.int32)
    be.set_block_table(cache, good)
    assert np.array_equal(cache.block_table, good)
    good[0, 0] = 5                                  # the caller's array stays theirs
    assert cache.block_table[0, 0] == 0
    for bad, what in ((np.full((2, 4), 6, np.int32), "block ids"),
                      (np.full((2, 4), -1, np.int32), "block ids"),
                      (np.zeros((2, 3), np.int32), r"\(2, 4\)"),
                      (np.zeros((3, 4), np.int32), r"\(2, 4\)"),
                      (np.zeros((2, 4), np.int64), "int32")):
        with pytest.raises(ValueError, match=what):
            be.set_block_table(cache, bad)
    assert np.array_equal(cache.block_table, [[0, 1, 2, 3], [5, 4, 0, 1]])   # unchanged


def test_the_draft_model_takes_a_block_table():
    tr, _ = build(CpuBackend(threads=1), 10, 16)
    drafter = ModelDrafter(tr, "tiny")
    table = np.arange(12, dtype=np.int32).reshape(3, 4) % 10
    drafter.set_block_table(table)
    assert np.array_equal(tr.cache.block_table, table)
