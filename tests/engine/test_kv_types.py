"""Every (K, V) pair of KV cache types on the CPU backend against the f16 cache (issue 21: the
reference system's f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0 for K and V chosen separately).

One SmolLM2 model is built once; each pair gets a fresh cache of its types in place of the f16
one and is teacher-forced on the first N_POS ids of a fixture case (prompt + llama.cpp's greedy
ids) in steps of 16 tokens (the decode / verify path). Checked per pair: the argmax equals the
f16 cache's wherever the f16 row's top-1/top-2 gap is clear (>= 0.5, the golden tests' near-tie
rule), at most one clear position excepted; and the centered top-8 logit difference (as in
test_engine.py's test_quantized_kv_cache) is above zero (the cache really rounds) and its mean
under the pair's bound. Kept to ~1 s a pair on 2 cores.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.formats import BACKEND_KV_TYPES, KV_TYPES, KVType
from tests.support.models import build_model, load_json, teacher_forced

N_POS = 24                # ids teacher-forced per pair: one 16-token step and one of 8
N_CTX = 32

# Mean centered top-8 difference against the f16 cache contributed by each side, measured on
# 40 positions of case 0 (`pytest -s tests/engine/test_kv_types.py` prints each pair): K's
# rounding moves logits more than V's (a key error changes every score of the row). A pair's
# bound is 1.5 x (its K side + its V side), so a pair whose rounding is off (a wrong scale, a
# swapped nibble) fails while float noise does not.
K_SIDE = {"f16": 0.0, "bf16": 0.006, "q8_0": 0.026, "q5_1": 0.15, "q5_0": 0.22, "q4_1": 0.32,
          "q4_0": 0.42}
V_SIDE = {"f16": 0.0, "bf16": 0.003, "q8_0": 0.009, "q5_1": 0.05, "q5_0": 0.07, "q4_1": 0.12,
          "q4_0": 0.13}
CLEAR_GAP = 0.5

PAIRS = [(k, v) for k in KV_TYPES for v in KV_TYPES]


def test_every_type_is_on_the_cpu_backend():
    assert set(BACKEND_KV_TYPES["cpu"]) == set(KVType) and len(PAIRS) == 49
    assert set(K_SIDE) == set(V_SIDE) == set(KV_TYPES)


@pytest.fixture(scope="module")
def smol_f16():
    tr = build_model("smollm2", n_ctx=N_CTX, max_tokens=16, type_k="f16", type_v="f16")
    case = load_json("llamacpp_smollm2_greedy.json")["cases"][0]
    ids = (case["prompt_ids"] + case["greedy_ids"])[:N_POS]
    assert len(ids) == N_POS
    return tr, ids, teacher_forced(tr, ids, 16)


@pytest.mark.parametrize("type_k,type_v", PAIRS)
def test_kv_pair_keeps_the_top1(type_k, type_v, smol_f16):
    tr, ids, ref = smol_f16
    s = tr.spec
    tr.cache = tr.backend.new_kv_cache(s.n_layer, 1, N_CTX, s.n_head_kv, s.head_dim,
                                       s.head_dim_v, type_k, type_v)
    rows = teacher_forced(tr, ids, 16)                                    # (N_POS, V)
    if (type_k, type_v) == ("f16", "f16"):
        np.testing.assert_array_equal(rows, ref)       # a fresh cache: the same bits
        return
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) >= CLEAR_GAP
    agree = rows.argmax(1) == ref.argmax(1)
    top = np.argsort(-ref, axis=1, kind="stable")[:, :8]                 # (n, 8)
    d = np.take_along_axis(rows, top, 1) - np.take_along_axis(ref, top, 1)
    d -= d.mean(axis=1, keepdims=True)
    worst, mean = float(np.abs(d).max()), float(np.abs(d).mean())
    bound = 1.5 * (K_SIDE[type_k] + V_SIDE[type_v])
    print(f"\nKV {type_k}+{type_v}: top-1 {agree[clear].sum()}/{clear.sum()} clear; centered "
          f"top-8 diff worst {worst:.3f} mean {mean:.4f} (bound {bound:.4f})")
    assert (~agree[clear]).sum() <= 1, (type_k, type_v, np.flatnonzero(clear & ~agree))
    assert 0 < worst and mean <= bound, (worst, mean, bound)
