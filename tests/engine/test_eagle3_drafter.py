"""The `eagle3` drafter through the engine on the CPU (service/engine/spec/eagle3_drafter.py):
tiny-qwen3 as the target, EAGLE-3 heads written for it.

- Its drafts equal the numpy reference's (service/model/eagle3_forward.py) fed the same tapped
  target rows, to the first near-tie of the reference's logits, after a prompt and again after
  a partial acceptance (the drafter's KV rolled back and rewritten with the target's rows).
- Speculative output equals plain output: greedy at widths 2, 6 and 16, seeded sampling, and a
  request alone equals it in a batch of four speculating requests, with a random-weight head
  (`synth --eagle3`: it drafts every step and is almost never right) and with a head made to
  agree with the target (bigram_head below), whose drafts are accepted.
- Trees (DDTree over the head's top 4 per depth) at budgets 4, 8 and 16 likewise, and the
  rows extended after a tree step are its accepted path's.

Setup and failure paths: tests/engine/test_eagle3_setup.py.

The agreeing head: its weights make it a bigram table, whatever the target's features (fc = 0,
the feature half of its attention input normed to 0 by a zero attn_norm_2 with
norm_before_residual, the FFN's down projection 0): its attention puts its weight on the rows
of the same token (queries and keys are scaled copies of the token's code, random vectors in
the head dims RoPE leaves alone) and the output layer maps each token's code to its successor
in the target's plain greedy output on the test prompts. It exercises the whole drafting path
(extend, chain, the drafter's KV); that its drafts are accepted says nothing about a trained
head's acceptance.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from service.engine.runner import GREEDY as ROW_GREEDY
from service.engine.runner import StepInput
from service.engine.spec.eagle3_drafter import Eagle3Drafter
from service.engine.types import SamplingParams
from service.gguf.reader import GGUFFile
from service.model.eagle3_forward import Eagle3Draft
from service.tools.synth_eagle3 import synthesize_eagle3, write_eagle3
from tests.engine.test_moe_speculation import PROMPTS, batch_equals_alone
from tests.support.engines import run, running_engine
from tests.support.models import model_path
from tests.support.speculation import (
    DraftSeq,
    greedy_equals_plain_at_widths,
    plain_greedy_ids,
    prefill_and_extend,
    sampled_equals_plain,
)

TARGET, N_NEW = "tiny-qwen3", 24
WIDTHS = (2, 6, 16)
SAMPLED = (SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, seed=11),
           SamplingParams(temperature=0.5, top_k=20, repetition_penalty=1.3, repeat_last_n=16,
                          seed=13))
NEAR_TIE = 0.05               # reference logit gap below which backend and reference may differ


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, Path]:
    """Random heads for tiny-qwen3: full vocabulary; reduced (d2t of 300 ids, own embeddings,
    the pre-fc norm)."""
    d = tmp_path_factory.mktemp("e3d")
    t = model_path(TARGET)
    return {"random": synthesize_eagle3(d / "random.gguf", t, seed=6, layers=(1, 2, 3),
                                        quant="F32", weight_std=0.1).path,
            "reduced": synthesize_eagle3(d / "reduced.gguf", t, seed=7, layers=(0, 2, 3),
                                         quant="F32", weight_std=0.1, draft_vocab=300,
                                         own_embedding=True, norm_before_fc=True).path}


def eagle3_engine(head: Path, **overrides):
    """tiny-qwen3 drafted for by `head`, verify width 16, drafting in full."""
    return running_engine(TARGET, **{"drafter": "eagle3", "draft_model": str(head),
                                     "verify_width": 16, **overrides}, draft_in_full=True)


@pytest.fixture(scope="module")
def plain_ids() -> list[list[int]]:
    with running_engine(TARGET) as eng:
        return plain_greedy_ids(eng, PROMPTS, N_NEW)


# ---------------------------------------------------------------- a head that agrees
def bigram_head(out: Path, successor: dict[int, int], scale: float = 2.0,
                quant: str = "F32") -> Path:
    """An EAGLE-3 head for tiny-qwen3 that drafts successor[t] after token t (module doc);
    its matrices in `quant` (F32, F16)."""
    tf = GGUFFile(model_path(TARGET))
    base = synthesize_eagle3(out.with_suffix(".base.gguf"), model_path(TARGET), layers=(1, 2, 3),
                             quant="F32", own_embedding=True).spec
    spec = replace(base, rope_dims=2, norm_before_residual=True)
    E, V, hd = spec.n_embd, spec.vocab_size, spec.head_dim
    assert (spec.n_head, spec.n_head_kv, hd, E) == (4, 2, 64, 256)
    code_dims = [*range(2, hd), *range(hd + 2, 2 * hd)]      # kv heads 0, 1 past RoPE's pair
    rng = np.random.default_rng(5)
    emb = np.zeros((V, E), np.float32)
    emb[:, code_dims] = rng.standard_normal((V, len(code_dims)))
    unit = emb / np.sqrt((emb ** 2).mean(1, keepdims=True))   # rms_norm(embedding) per token
    eye = np.eye(hd, dtype=np.float32)
    q = np.zeros((4 * hd, 2 * E), np.float32)
    kv = np.zeros((2 * hd, 2 * E), np.float32)
    for h in range(4):                                        # heads 0, 1 -> kv 0; 2, 3 -> kv 1
        q[h * hd:(h + 1) * hd, (h // 2) * hd:(h // 2 + 1) * hd] = scale * eye
    for h in range(2):
        kv[h * hd:(h + 1) * hd, h * hd:(h + 1) * hd] = eye
    wo = np.zeros((E, 4 * hd), np.float32)
    wo[0:hd, 0:hd] = eye                                      # head 0 -> dims 0..63
    wo[hd:2 * hd, 2 * hd:3 * hd] = eye                        # head 2 -> dims 64..127
    output = np.zeros((V, E), np.float32)
    for t, u in successor.items():
        output[u] += unit[t]
    ones, zeros = np.ones(E, np.float32), np.zeros(E, np.float32)
    F = spec.n_ff
    tensors = {"fc.weight": np.zeros((E, 3 * E), np.float32),
               "blk.0.attn_norm.weight": ones, "blk.0.attn_norm_2.weight": zeros,
               "blk.0.attn_q.weight": q, "blk.0.attn_k.weight": kv, "blk.0.attn_v.weight": kv,
               "blk.0.attn_output.weight": wo, "blk.0.ffn_norm.weight": ones,
               "blk.0.ffn_gate.weight": np.zeros((F, E), np.float32),
               "blk.0.ffn_up.weight": np.zeros((F, E), np.float32),
               "blk.0.ffn_down.weight": np.zeros((E, F), np.float32),
               "output_norm.weight": ones, "output.weight": output, "token_embd.weight": emb}
    assert set(tensors) == set(spec.tensor_shapes())
    return write_eagle3(out, tf, spec, tensors, quant).path


def successors(prompts, outputs) -> dict[int, int]:
    """Each token's most frequent successor in the greedy outputs (after each prompt's end)."""
    pairs: dict[int, Counter] = {}
    for p, ids in zip(prompts, outputs, strict=True):
        seq = [p[-1], *ids]
        for a, b in zip(seq, seq[1:], strict=False):
            pairs.setdefault(a, Counter())[b] += 1
    return {a: c.most_common(1)[0][0] for a, c in pairs.items()}


@pytest.fixture(scope="module")
def agreeing(plain_ids, tmp_path_factory) -> Path:
    """The bigram head fitted to the target's plain greedy output on PROMPTS."""
    return bigram_head(tmp_path_factory.mktemp("e3b") / "bigram.gguf",
                       successors(PROMPTS, plain_ids))


# ---------------------------------------------------------------- against the reference
def reference_chain(ref: Eagle3Draft, feats: np.ndarray, history: list[int], k: int
                    ) -> tuple[list[int], list[float], np.ndarray]:
    """The reference's k drafts after `history` from the target's rows feats (H - 1, 3 Et) of
    positions 0..H-2, the top-1/top-2 logit gap of the row choosing each, and the pre-norm
    output (E,) of the row at H - 2 (the seed's, which chooses d1)."""
    H = len(history)
    logits, y = ref.decode(history[1:], ref.encode(feats), 0)             # (H-1, V), (H-1, E)
    ids, gaps, row, g, y_seed = [], [], logits[-1], y[-1:], y[-1]
    for i in range(k):
        top = np.sort(row)[-2:]
        ids.append(int(row.argmax()))
        gaps.append(float(top[1] - top[0]))
        if i + 1 < k:
            out, y = ref.decode([ids[-1]], g, H - 1 + i)
            row, g = out[0], y
    return ids, gaps, y_seed


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).mean() / (b ** 2).mean()))


def agree_to_first_tie(got: list[int], want: list[int], gaps: list[float]) -> int:
    """Drafts compared up to and including the first whose reference gap is a near-tie (after
    it the two chains may part): the number compared."""
    n = 0
    for a, b, gap in zip(got, want, gaps, strict=True):
        if gap < NEAR_TIE:
            break
        assert a == b, (got, want, gaps)
        n += 1
    return n


def reference(d: Eagle3Drafter, head: Path) -> Eagle3Draft:
    """The numpy reference of `head` (the spec the drafter `d` read from it) over the target's
    file, for 64 positions."""
    return Eagle3Draft(d.spec, GGUFFile(head), GGUFFile(model_path(TARGET)), 64)


@pytest.mark.parametrize("which", ["random", "reduced"])
def test_drafts_equal_the_reference_after_a_prompt_and_a_rollback(heads, which):
    """A 9-token prompt prefilled (tapped), then a verify step of [seed, d1..d5] of which the
    target keeps the seed and d1..d2 plus a bonus token: both times the drafter's 6 drafts
    equal the numpy reference's, fed the same target rows, up to its first near-tie."""
    prompt = [(37 * i + 11) % 1024 for i in range(9)]
    with eagle3_engine(heads[which], start=False) as eng:
        d, runner = eng.drafter, eng.runner
        assert isinstance(d, Eagle3Drafter) and runner.hidden_tap == d.tap
        ref = reference(d, heads[which])
        P = len(prompt)
        st, seed, feats = prefill_and_extend(d, runner, prompt)
        # the seed row's pre-norm output, kept per slot for the chain (f16 KV: 0.2%)
        y_seed = np.array(d._y[0])
        got = d.propose(st, 6)
        want, gaps, y_want = reference_chain(ref, feats, st.history, 6)
        assert rel(y_seed, y_want) <= 2e-3
        compared = agree_to_first_tie(got, want, gaps)
        # the verify step: rows seed, d1..d5 at positions P..P+5; keep 3, then a bonus token
        rows = [seed, *got[:5]]
        vin = StepInput(rows, range(P, P + 6), [0] * 6, range(6), [ROW_GREEDY] * 6, hidden=True)
        runner.step(vin)
        vfeats = np.array(runner.hidden_states(vin))                     # (6, 3Et)
        bonus = (got[2] + 1) % 1024
        st.history += [*got[:2], bonus]
        d.extend(st, range(3), range(P, P + 3), runner.hidden_states(vin))
        y_seed = np.array(d._y[0])
        again = d.propose(st, 6)
        ref2 = reference(d, heads[which])
        want2, gaps2, y_want = reference_chain(ref2, np.concatenate([feats, vfeats[:3]]),
                                               st.history, 6)
        assert rel(y_seed, y_want) <= 2e-3
        compared += agree_to_first_tie(again, want2, gaps2)
        if d.spec.has_d2t:
            assert set(got + again) <= set(d.model.d2t.tolist())
    print(f"\n{which}: {compared}/12 drafts compared before a near-tie")
    assert compared >= 4


def test_drafts_equal_the_reference_after_a_branch_of_a_tree(heads):
    """A tree of 8 nodes over the head's top-3 per depth (candidates) is verified in one
    tapped step; the target is taken to accept the second candidate at depth 1 (a branch) and
    choose a bonus: the drafter, extended with the path's rows (committed_rows), drafts what
    the reference drafts from the prompt's rows and the path's."""
    from service.engine.spec.decode import committed_rows
    from service.engine.spec.tree import build_tree
    from service.engine.spec.tree_verify import rows as tree_rows
    from service.engine.spec.tree_verify import step_fields

    prompt = [(53 * i + 5) % 1024 for i in range(10)]
    with eagle3_engine(heads["random"], start=False) as eng:
        d, runner = eng.drafter, eng.runner
        P = len(prompt)
        st, seed, feats = prefill_and_extend(d, runner, prompt)
        chain, ids, logp = d.candidates(st, 3, 3)
        assert chain == ids[:, 0].tolist() and (np.diff(logp, axis=1) <= 0).all()
        assert chain == d.propose(st, 3)
        tree = build_tree(seed, ids, logp, 8)
        seg = tree_rows(tree, P)
        n = tree.n
        vin = StepInput(seg.ids, seg.positions, [0] * n, range(n), [ROW_GREEDY] * n,
                        hidden=True, **step_fields([seg]))
        runner.step(vin)
        branch = int(ids[0, 1])
        assert branch in tree.tokens[tree.parents == 0].tolist()
        st.history += [branch, 777]
        rows = committed_rows(vin, 0, st.history)
        assert [int(tree.tokens[r]) for r in rows] == [seed, branch]
        d.extend(st, rows, np.asarray(vin.positions)[rows], runner.hidden_states(vin))
        y_seed = np.array(d._y[0])
        got = d.propose(st, 5)
        vfeats = np.array(runner.hidden_states(vin))[rows]                # (2, 3Et)
        ref = reference(d, heads["random"])
        want, gaps, y_want = reference_chain(ref, np.concatenate([feats, vfeats]), st.history,
                                             5)
    assert rel(y_seed, y_want) <= 2e-3
    assert agree_to_first_tie(got, want, gaps) >= 2


def test_a_stale_slot_proposes_nothing(heads):
    """Before its rows are extended to the seed's predecessor, a slot drafts nothing."""
    with eagle3_engine(heads["random"], start=False) as eng:
        st = DraftSeq(0, [5, 6, 7])
        eng.drafter.start(st)
        assert eng.drafter.propose(st, 4) == []
        eng.drafter.release(st)
        assert eng.drafter.slots_in_use == frozenset()


# ---------------------------------------------------------------- identity through the engine
@pytest.mark.parametrize("which", ["random", "reduced", "agreeing"])
def test_greedy_speculation_equals_plain_greedy(heads, agreeing, plain_ids, which):
    head = agreeing if which == "agreeing" else heads[which]
    with eagle3_engine(head) as eng:
        assert isinstance(eng.drafter, Eagle3Drafter)
        assert eng.info.drafter == "eagle3" and "EAGLE-3" in eng.info.draft_model
        for got in greedy_equals_plain_at_widths(eng, PROMPTS, plain_ids, widths=WIDTHS,
                                                 max_new_tokens=N_NEW, label=which):
            if which == "agreeing":      # a bigram table along a greedy loop: d1 mostly right
                assert got.rate > (0.5 if got.width == 2 else 0.2)


@pytest.mark.parametrize("which", ["random", "agreeing"])
def test_sampled_speculation_equals_plain_sampling(heads, agreeing, which):
    head = agreeing if which == "agreeing" else heads[which]
    drafted = accepted = 0
    with eagle3_engine(head, verify_width=6) as eng:
        for params in SAMPLED:
            d, a = sampled_equals_plain(eng, PROMPTS, params)
            drafted, accepted = drafted + d, accepted + a
    print(f"\n{which}, sampled: {accepted}/{drafted} drafts accepted")
    assert drafted > 0


@pytest.mark.parametrize("which", ["random", "agreeing"])
def test_a_request_alone_equals_it_in_a_speculating_batch(heads, agreeing, which):
    head = agreeing if which == "agreeing" else heads[which]
    with eagle3_engine(head, n_slots=4, verify_width=6) as eng:
        got = batch_equals_alone(eng, "eagle3")
    if which == "agreeing":
        assert sum(g.finished.usage.accepted_draft_tokens for g in got) > 0


def test_a_long_prompt_in_chunks_with_a_cached_prefix(heads):
    """Prompts longer than a prefill chunk, the second sharing the first's prefix (its cached
    blocks are not recomputed, so the drafter never sees those rows): output equals plain."""
    prompt = [(13 * i + 3) % 1000 + 1 for i in range(70)]
    other = prompt[:48] + [7, 8, 9]
    with eagle3_engine(heads["random"], prefill_chunk=16, verify_width=4) as eng:
        for p in (prompt, other, prompt):
            spec = run(eng, p, max_new_tokens=12, ignore_eos=True)
            plain = run(eng, p, max_new_tokens=12, ignore_eos=True, speculative=False)
            assert spec.token_ids == plain.token_ids
            assert spec.finished.usage.draft_tokens > 0


# ---------------------------------------------------------------- tree verify
@pytest.mark.parametrize("which", ["random", "reduced", "agreeing"])
def test_trees_equal_plain_greedy(heads, agreeing, plain_ids, which):
    """Tree verify (DDTree over the head's top-4 per depth) at budgets 4, 8 and 16."""
    head = agreeing if which == "agreeing" else heads[which]
    with eagle3_engine(head, tree_budget=4) as eng:
        for budget in (4, 8, 16):
            eng.config = replace(eng.config, tree_budget=budget)
            moves, drafted, accepted = eng.stats.kv_moves, 0, 0
            for prompt, plain in zip(PROMPTS, plain_ids, strict=True):
                out = run(eng, prompt, max_new_tokens=N_NEW, ignore_eos=True)
                assert out.token_ids == plain, (which, budget, prompt)
                drafted += out.finished.usage.draft_tokens
                accepted += out.finished.usage.accepted_draft_tokens
            print(f"\n{which} tree budget {budget}: {accepted}/{drafted} drafts accepted, "
                  f"{eng.stats.kv_moves - moves} KV moves")
            assert drafted > 0
            if which == "agreeing":
                assert accepted > 0


def test_committed_rows_of_a_tree_are_its_accepted_path():
    """committed_rows picks the accepted path's rows of a branching tree (not the siblings
    that share its positions), in position order, among a chunk's and a chain's rows."""
    from service.engine.spec.decode import committed_rows
    from service.engine.spec.tree import build_tree
    from service.engine.spec.tree_verify import rows as tree_rows
    from service.engine.spec.tree_verify import step_fields

    cand = np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    logp = np.tile([-0.1, -0.2, -3.0], (3, 1))
    tree = build_tree(5, cand, logp, 8)
    seg = tree_rows(tree, 40)
    chain = tree_rows([7, 8, 9], 12)
    ids = [*chain.ids, *seg.ids]
    fields = step_fields([chain, seg])
    inp = StepInput(ids, [*chain.positions, *seg.positions], [1] * 3 + [0] * tree.n, (),
                    (), **fields)
    # the target took 11 (second at depth 1), then 20 under it, then chose a bonus
    path_tokens = [5, 11, 20]
    history = [0] * 40 + path_tokens + [99]
    want = [3 + i for i in range(tree.n) if tree.tokens[i] in (5, 11) or (
        tree.tokens[i] == 20 and tree.tokens[tree.parents[i]] == 11)]
    assert len(want) == 3
    assert committed_rows(inp, 0, history).tolist() == want
    # the chain in slot 1 accepted 8 (position 13): rows 0 and 1
    assert committed_rows(inp, 1, [0] * 12 + [7, 8, 50]).tolist() == [0, 1]
