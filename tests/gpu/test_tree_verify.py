"""Tree verify on the CUDA backend: the masked attention and rope_kv kernels against the CPU
backend, ordinary rows unchanged by the tree arrays, the kv_move kernel, and the tree identity
gate (greedy output with tree verify equals plain greedy output up to the first near-tie).

Tree rows are not bit-identical to plain decoding on the GPU: the attention kernel tiles keys by
KV row, and a node's row (committed + node index) differs from the row plain decoding writes
(committed + depth), so sums run in another order. Hence the near-tie rule
(tests/support/near_ties.py) in the identity gate, and the CPU comparison's bound of
test_kernels.py's attention test.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from service.engine.types import (
    Collected,
    Delta,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from tests.gpu.test_kernels import PAIRS, _gpu_cache_values, _kv_pair_caches, poisoned
from tests.gpu.test_models import cuda_engine, real_path
from tests.support.models import load_json
from tests.support.near_ties import logprob_gap

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu
N_NEW = 32


def _tree_rows():
    """Rows of slot 0 and 1: a 6-node tree at committed 290 (split boundary 256..384 inside
    its prefix; node rows 290..295), an ordinary row, and a row with lo = 240 and a sparse
    mask that reaches across the split boundary at 256 (rows 240, 245 and 271)."""
    parents = [-1, 0, 1, 0, 3, 1]
    depth, bits = [], []
    for i, p in enumerate(parents):
        depth.append(depth[p] + 1 if p >= 0 else 0)
        bits.append((bits[p] if p >= 0 else 0) | 1 << i)
    committed = 290
    pos = [committed + d for d in depth] + [599, 250]
    lo = [committed] * 6 + [600, 240]
    mask = bits + [0, (1 << 0) | (1 << 5) | (1 << 31)]
    slots = [0] * 6 + [1, 1]
    return (np.array(a, np.int64).astype(np.int32) for a in (pos, lo, mask, slots))


@pytest.mark.parametrize("type_k,type_v", PAIRS)
def test_masked_attention_against_cpu(cuda, type_k, type_v):
    cpu, cc, gc = _kv_pair_caches(cuda, type_k, type_v)
    cuda.prepare(max_tokens=16, n_head=8, head_dim_v=64, n_ctx=600, n_embd=64)
    pos, lo, mask, slots = _tree_rows()
    T = len(pos)
    q = np.random.default_rng(21).normal(0, 1, (T, 8, 64)).astype(np.float32)
    g = [cp.asarray(a) for a in (slots, pos, lo, mask)]
    for window in (0, 200):
        out = poisoned(cuda, (T, 8, 64))
        cuda.attention(cp.asarray(q), gc, 0, g[0], g[1], 600, window, 0.125, out, g[2], g[3])
        ref = np.empty((T, 8, 64), np.float32)
        cpu.attention(q, cc, 0, slots, pos, 600, window, 0.125, ref, lo, mask)
        got = cuda.to_host(out)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), window
        # the ordinary row (6) gives the same bits without the arrays
        plain = poisoned(cuda, (1, 8, 64))
        cuda.attention(cp.asarray(q[6:7]), gc, 0, g[0][6:7], g[1][6:7], 600, window, 0.125,
                       plain)
        assert np.array_equal(cuda.to_host(plain)[0], got[6]), window


@pytest.mark.parametrize("type_k,type_v", [("f16", "f16"), ("q8_0", "q4_0")])
def test_rope_kv_stores_at_the_kv_rows(cuda, type_k, type_v):
    from service.backends.cpu.backend import CpuBackend

    T, H, hkv, D, n_ctx = 4, 4, 2, 64, 64
    pos = np.array([10, 11, 11, 12], np.int32)           # RoPE positions (depths)
    kvp = np.array([10, 11, 12, 13], np.int32)           # KV rows (node indices)
    slots = np.array([1, 1, 1, 1], np.int32)
    rng = np.random.default_rng(22)
    q, k, v = (rng.normal(0, 1, (T, h, D)).astype(np.float32) for h in (H, hkv, hkv))
    gc = cuda.new_kv_cache(1, 2, n_ctx, hkv, D, D, type_k, type_v)
    gq = cp.asarray(q)
    cuda.rope_kv(gq, cp.asarray(k), cp.asarray(v), None, None, 1e-6, cp.asarray(pos),
                 cp.asarray(slots), cuda.rope_table(n_ctx, D, 10000.0), False, gc, 0,
                 cp.asarray(kvp))
    cpu = CpuBackend()
    cc = cpu.new_kv_cache(1, 2, n_ctx, hkv, D, D, type_k, type_v)
    cpu.rope_kv(q, k, v, None, None, 1e-6, pos, slots, cpu.rope_table(n_ctx, D, 10000.0),
                False, cc, 0, kvp)
    assert np.array_equal(cuda.to_host(gq), q)
    for planes, kind, want in ((gc.k[0], type_k, cc.k[0]), (gc.v[0], type_v, cc.v[0])):
        assert np.array_equal(_gpu_cache_values(planes, kind, want.shape), want), kind


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_0"])
def test_kv_move_kernel(cuda, kind):
    """Moves applied in order, every layer and plane: rows 12 -> 11 then 13 -> 12 of slot 1
    (the second overwrites the first's source), 40 -> 30 of slot 0; nothing else changes."""
    gc = cuda.new_kv_cache(3, 2, 64, 2, 64, 64, kind, kind)
    rng = np.random.default_rng(23)
    for layer in range(3):
        for planes in (gc.k[layer], gc.v[layer]):
            for p in planes:
                if p is not None:
                    p[...] = cp.asarray(rng.integers(0, 1 << 14, p.shape).astype(p.dtype))
    before = [[cp.asnumpy(p) for p in (*gc.k[i], *gc.v[i]) if p is not None] for i in range(3)]
    moves = [(1, 12, 11), (1, 13, 12), (0, 40, 30)]
    s, a, b = (cp.asarray(np.array(c, np.int32)) for c in zip(*moves, strict=True))
    cuda.kv_move(gc, s, a, b)
    for i in range(3):
        for p, old in zip([p for p in (*gc.k[i], *gc.v[i]) if p is not None], before[i],
                          strict=True):
            want = old.reshape(2, 64, -1).copy()
            for slot, src, dst in moves:
                want[slot, dst] = want[slot, src]
            assert np.array_equal(cp.asnumpy(p).reshape(2, 64, -1), want), (kind, i)


def _run(eng, ids, speculative):
    req = GenerationRequest("g", tuple(ids), SamplingParams(temperature=0.0),
                            StoppingCriteria(max_new_tokens=N_NEW, ignore_eos=True),
                            speculative=speculative, top_logprobs=2)
    out, gaps = Collected(), []
    for e in eng.generate(req, timeout=300):
        out.add(e)
        if isinstance(e, Delta):
            gaps += [logprob_gap(lp) for lp in e.logprobs]
    assert len(gaps) == len(out.token_ids)
    return out, gaps


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_tree_verify_is_lossless_on_cuda(requantized, model):
    draft = requantized(real_path(model), "q8_0", 4)
    fixture = {"smollm2": "llamacpp_smollm2_greedy.json",
               "gemma3": "llamacpp_gemma3_greedy.json"}[model]
    with cuda_engine(model, drafter="model", draft_model=str(draft), verify_width=16,
                     tree_budget=4, n_slots=1, draft_in_full=True) as eng:
        for budget in (4, 8, 16):
            eng.config = replace(eng.config, tree_budget=budget)
            drafted = compared = 0
            for case in load_json(fixture)["cases"]:
                plain, plain_gaps = _run(eng, case["prompt_ids"], False)
                tree, tree_gaps = _run(eng, case["prompt_ids"], None)
                # a tree row runs over its path's logical key positions (attention.cu),
                # so it computes plain decoding's bits: the same ids, not only to a near-tie
                assert tree.token_ids == plain.token_ids, (model, budget, case["name"])
                compared += len(plain.token_ids)
                drafted += tree.finished.usage.draft_tokens
            print(f"\n{model} budget {budget}: {compared} ids compared, {drafted} drafted, "
                  f"{eng.stats.kv_moves} KV moves so far")
            assert drafted > 0 and compared > 0


def test_off_chain_paths_are_compacted_on_cuda():
    """The CPU test's second-best drafter (top-1 wrong, top-2 right) on the GPU: every accepted
    draft is a branch node whose KV rows move."""
    from tests.engine.test_tree_verify import SecondBestDrafter

    cases = load_json("llamacpp_smollm2_greedy.json")["cases"]
    with cuda_engine("smollm2", drafter="ngram", tree_budget=8, n_slots=1,
                     draft_in_full=True) as eng:
        plain = {tuple(c["prompt_ids"]): _run(eng, c["prompt_ids"], False) for c in cases}
        eng.drafter = SecondBestDrafter({p: list(o.token_ids) for p, (o, _) in plain.items()},
                                        eng.spec.vocab_size)
        accepted = 0
        for p, (ref, _) in plain.items():
            tree, gaps = _run(eng, p, None)
            assert tree.token_ids == ref.token_ids
            accepted += tree.finished.usage.accepted_draft_tokens
        assert accepted > 0 and eng.stats.kv_moves >= accepted
