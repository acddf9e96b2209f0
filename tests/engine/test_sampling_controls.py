"""Frequency / presence penalties, logit_bias and min_tokens on the CPU backend (SmolLM2): each
changes the output as its math says (greedy ids against the numpy reference applied to
teacher-forced logits), and the output does not depend on speculation or on the batch."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from service.backends.cpu import sampling as ref
from service.engine.runner.step import Adjustment
from service.engine.sampling import Sampler
from service.engine.types import (
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from tests.support.batching import alone, same_output, smollm2_prompts, together
from tests.support.engines import run
from tests.support.models import build_model, teacher_forced

N_NEW = 24


@pytest.fixture(scope="module")
def forced():
    """Teacher-forced logits of SmolLM2 in steps of 16 (rows equal to single-token steps)."""
    tr = build_model("smollm2", n_ctx=512, max_tokens=16)
    return lambda ids: teacher_forced(tr, list(ids), 16)


def adjusted_rows(rows: np.ndarray, n_prompt: int, ids: list[int], p: SamplingParams
                  ) -> np.ndarray:
    """The logits each generated token was chosen from, by the numpy formulas: row i (choosing
    generated token i) minus (count * frequency + presence) over generated[:i], plus bias."""
    out = []
    for i in range(len(ids) - n_prompt):
        row = rows[n_prompt - 1 + i].astype(np.float32)
        gen = np.asarray(ids[n_prompt:n_prompt + i], np.int64)
        counts = np.bincount(gen, minlength=row.size).astype(np.float32)
        seen = counts > 0
        row = row.copy()
        row[seen] = row[seen] - (counts[seen] * np.float32(p.frequency_penalty)
                                 + np.float32(p.presence_penalty))
        for tok, b in p.logit_bias:
            row[tok] = row[tok] + np.float32(b)
        out.append(row)
    return np.array(out)


def check_greedy(forced, prompt, got: list[int], p: SamplingParams) -> int:
    """Every generated id is the argmax of its adjusted teacher-forced row, up to the first
    near-tie (1e-3 logits); returns how many were checked."""
    ids = list(prompt) + got
    rows = adjusted_rows(forced(ids[:-1]), len(prompt), ids, p)
    for i, row in enumerate(rows):
        top = np.sort(row)[-2:]
        if top[1] - top[0] < 1e-3:
            return i
        assert int(np.argmax(row)) == got[i], (i, got)
    return len(rows)


@pytest.mark.parametrize("freq,pres", [(0.0, 1.5), (1.0, 0.0), (-0.5, 0.7), (2.0, 2.0)])
def test_penalties_follow_the_numpy_formula(smol, forced, freq, pres):
    prompt = smollm2_prompts()[0]
    p = SamplingParams(temperature=0.0, frequency_penalty=freq, presence_penalty=pres)
    plain = run(smol, prompt, max_new_tokens=N_NEW, ignore_eos=True).token_ids
    got = run(smol, prompt, p, max_new_tokens=N_NEW, ignore_eos=True).token_ids
    assert check_greedy(forced, prompt, got, p) >= 8
    if freq > 0 or pres > 0:          # the plain output repeats tokens; the penalised differs
        assert got != plain


def test_presence_penalty_equals_the_sampler_reference():
    """The op's frequency / presence step against numpy written out, on a random row."""
    rng = np.random.default_rng(0)
    row = rng.standard_normal(50).astype(np.float32) * 3
    gen = [3, 7, 3, 3, 11]
    s = Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.25, presence_penalty=1.5),
                50, 0)
    ids, probs = s.distribution(row, [1, 2] + gen, n_generated=len(gen))
    want = row.copy()
    for tok, c in ((3, 3), (7, 1), (11, 1)):
        want[tok] = want[tok] - (np.float32(c) * np.float32(0.25) + np.float32(1.5))
    assert ids.tolist() == [int(np.argmax(want))]
    assert s.sample(row, [1, 2] + gen, n_generated=len(gen)) == int(np.argmax(want))
    got = ref.counted(row, np.array(gen, np.int32), np.float32(0.25), np.float32(1.5))
    assert np.array_equal(got, want)


def test_a_huge_negative_bias_bans_a_token(smol, forced):
    prompt = smollm2_prompts()[1]
    plain = run(smol, prompt, max_new_tokens=N_NEW, ignore_eos=True).token_ids
    banned = plain[0]
    p = SamplingParams(temperature=0.0, logit_bias=((banned, -100.0), (plain[3], 5.0)))
    got = run(smol, prompt, p, max_new_tokens=N_NEW, ignore_eos=True).token_ids
    assert banned not in got and got[0] != plain[0]
    assert check_greedy(forced, prompt, got, p) >= 8
    sampled = run(smol, prompt, SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0,
                                               seed=3, logit_bias=((banned, -100.0),)),
                  max_new_tokens=N_NEW, ignore_eos=True).token_ids
    assert banned not in sampled


def test_min_tokens_holds_eos_back(smol):
    """A +100 bias on EOS ends the generation at once; min_tokens 5 bans it for 5 tokens (and
    a stop token with it), then the bias wins: 5 other tokens, then EOS."""
    prompt = smollm2_prompts()[2]
    eos = smol.tokenizer.eos_id
    p = SamplingParams(temperature=0.0, logit_bias=((eos, 100.0),))
    first = run(smol, prompt, p, max_new_tokens=N_NEW)
    assert first.token_ids == [eos] and first.finished.reason is FinishReason.EOS
    plain = run(smol, prompt, max_new_tokens=N_NEW, ignore_eos=True).token_ids
    out = run(smol, prompt, p, max_new_tokens=N_NEW, min_tokens=5,
              stop_token_ids=(plain[0],))
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos
    assert eos not in out.token_ids[:5] and plain[0] not in out.token_ids[:5]
    assert out.finished.reason is FinishReason.EOS


def test_min_tokens_defers_stop_sequences(smol):
    prompt = smollm2_prompts()[0]
    plain = run(smol, prompt, max_new_tokens=N_NEW, ignore_eos=True)
    piece = smol.tokenizer.decode([plain.token_ids[1]])
    assert piece.strip()
    stopped = run(smol, prompt, max_new_tokens=N_NEW, ignore_eos=True, stop_sequences=(piece,))
    assert stopped.finished.reason is FinishReason.STOP_SEQUENCE and len(stopped.token_ids) <= 2
    late = run(smol, prompt, max_new_tokens=N_NEW, ignore_eos=True, stop_sequences=(piece,),
               min_tokens=N_NEW)
    assert late.token_ids == plain.token_ids and late.finished.reason is FinishReason.LENGTH
    assert late.text == plain.text


def controlled(i: int, greedy: bool) -> SamplingParams:
    bias = ((100 + i, -100.0), (2000 + 7 * i, 3.0), (13, 1.5))
    if greedy:
        return SamplingParams(temperature=0.0, frequency_penalty=0.4 * (i % 3),
                              presence_penalty=0.6, logit_bias=bias)
    return SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=500 + i,
                          frequency_penalty=0.5, presence_penalty=0.3 * (i % 2), logit_bias=bias,
                          repetition_penalty=1.1 if i % 2 else 1.0, repeat_last_n=16)


def controlled_requests(spec: bool | None) -> list[GenerationRequest]:
    prompts = smollm2_prompts()
    return [GenerationRequest(f"c{i}-{spec}", tuple(prompts[i % len(prompts)]),
                              controlled(i, i % 2 == 0),
                              StoppingCriteria(max_new_tokens=20, min_tokens=4 + i),
                              speculative=spec, top_logprobs=1 if i == 1 else 0)
            for i in range(4)]


def test_controls_are_exact_under_speculation_and_batching(smol, monkeypatch):
    """Greedy and seeded requests with penalties, bias and min_tokens: speculation on (n-gram
    drafter) equals off, and together equals alone."""
    # verification taken as free, so drafts are verified whatever the start-up cost
    # measurement found on this machine (tests.support.engines: draft_in_full)
    monkeypatch.setattr(smol, "verify_alpha", 0.0)
    off = [alone(smol, r) for r in controlled_requests(False)]
    on = [alone(smol, r) for r in controlled_requests(None)]
    for a, b in zip(on, off, strict=True):
        assert same_output(a, b), (a.token_ids, b.token_ids)
    assert sum(r.finished.usage.draft_tokens for r in on) > 0
    batched, _ = together(smol, controlled_requests(None))
    for a, b in zip(batched, off, strict=True):
        assert same_output(a, b), (a.token_ids, b.token_ids)


def test_adjustment_pairs():
    a = Adjustment.of(((9, 1.5), (2, -3.0)), banned=(9, 4))
    assert a.pairs[:, 0].tolist() == [2, 4, 9]
    assert a.pairs[:, 1].view(np.float32).tolist() == [-3.0, -np.inf, -np.inf]
    assert Adjustment.of(()) is None


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_a_direct_computation(smol, forced, k):
    """Started's prompt log-probabilities are log_softmax of the teacher-forced logits at each
    prompt position for the next prompt token (and its k best alternatives); the generation is
    the one without them. The prompt is longer than a logits step (64 rows)."""
    prompt = (smollm2_prompts()[0] * 8)[:150]
    plain = run(smol, prompt, max_new_tokens=4, ignore_eos=True)
    out = run(smol, prompt, max_new_tokens=4, ignore_eos=True, prompt_logprobs=k)
    assert out.token_ids == plain.token_ids
    lps = out.started.prompt_logprobs
    assert [lp.token_id for lp in lps] == prompt[1:]
    rows = forced(prompt[:-1]).astype(np.float64)
    want = rows - (rows.max(1, keepdims=True)
                   + np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1, keepdims=True)))
    got = np.array([lp.logprob for lp in lps])
    np.testing.assert_allclose(got, want[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
    for p, lp in enumerate(lps):
        assert len(lp.top) == k
        if k:
            assert lp.top[0][0] == int(np.argmax(rows[p])) or (
                np.sort(rows[p])[-1] - np.sort(rows[p])[-2] < 1e-3)
            np.testing.assert_allclose([v for _, v in lp.top], np.sort(want[p])[::-1][:k],
                                       atol=1e-4)
    assert plain.started.prompt_logprobs == ()


def test_bias_and_min_tokens_are_exact_in_tree_mode():
    """Tree verify rows take the adjustment of their own depth's token index: logit_bias and
    min_tokens with tree speculation give the plain tokens (penalties verify chains)."""
    from tests.support.engines import running_engine

    with running_engine("smollm2", n_ctx=512, tree_budget=8, draft_in_full=True) as eng:
        for i, r in enumerate(controlled_requests(None)):
            p = replace(r.sampling, frequency_penalty=0.0, presence_penalty=0.0,
                        repetition_penalty=1.0)
            tree = alone(eng, replace(r, sampling=p, speculation=None))
            off = alone(eng, replace(r, sampling=p, speculative=False, speculation=None))
            assert same_output(tree, off), (i, tree.token_ids, off.token_ids)
            if i == 0:
                assert tree.finished.usage.draft_tokens > 0
