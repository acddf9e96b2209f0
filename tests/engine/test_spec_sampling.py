"""Sampled requests speculate, exactly: with drafts verified by the rows' own seeded draws, the
output equals plain seeded sampling token for token (SmolLM2 with the n-gram drafter and with a
full q8_0 self-drafter, a tiny model drafting for itself; several seeds, temperatures, top-k,
top-p, min-p and the repetition penalty). A chi-square test checks the acceptance rule through
the model runner's step, against a biased rule as negative control. Then the step profiler and
the per-step token counts in Usage."""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.counter_rng import counter_uniform
from service.backends.cpu.backend import CpuBackend
from service.engine.runner import ModelRunner, RowSampling, StepInput
from service.engine.sampling import Sampler
from service.engine.spec.chain import accept_chain
from service.engine.spec.rejection import ACCEPT_STREAM
from service.engine.types import FinishReason, SamplingParams
from service.model.transformer import positions_for
from tests.support.engines import Engine, run, running_engine
from tests.support.models import build_model, load_json, model_path
from tests.unit.test_rejection import P_FAIL, P_PASS, chi2_pvalue

SAMPLED = {
    "t0.7-k40-p0.95": SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=1),
    "t1-full": SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=2),
    "t0.4-k10-p0.8": SamplingParams(temperature=0.4, top_k=10, top_p=0.8, min_p=0.0, seed=3),
    "t0.8-penalty": SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.3,
                                   repeat_last_n=16, seed=4),
    "greedy-penalty": SamplingParams(temperature=0.0, repetition_penalty=1.2, repeat_last_n=8),
}
N_NEW = 32


def engine(model: str, **overrides):
    """Drafting in full: the measured verify cost (the machine's load) must not decide."""
    return running_engine(model, **overrides, draft_in_full=True)


def self_drafting(model: str, **overrides):
    """`model` drafting for itself with the model drafter."""
    return engine(model, drafter="model", draft_model=str(model_path(model)), **overrides)


def compare(eng: Engine, prompts, configs, top_logprobs: int = 0) -> tuple[int, int]:
    """Every prompt under every sampling config, speculating and plain: the same tokens, text
    and log-probabilities. Returns (drafted, accepted) summed over the speculating runs."""
    drafted = accepted = 0
    for name, params in configs.items():
        for i, ids in enumerate(prompts):
            kw = {"max_new_tokens": N_NEW, "ignore_eos": True, "top_logprobs": top_logprobs}
            plain = run(eng, ids, params, speculative=False, **kw)
            spec = run(eng, ids, params, speculative=True, **kw)
            assert spec.token_ids == plain.token_ids, (name, i)
            assert spec.text == plain.text
            if params.seed is not None:
                assert spec.started.seed == plain.started.seed == params.seed
            assert plain.finished.usage.draft_tokens == 0
            u = spec.finished.usage
            drafted += u.draft_tokens
            accepted += u.accepted_draft_tokens
    return drafted, accepted


def smol_prompts() -> list[list[int]]:
    return [c["prompt_ids"] for c in load_json("llamacpp_smollm2_greedy.json")["cases"][:3]]


def test_sampled_speculation_equals_plain_sampling_ngram():
    with engine("smollm2", verify_width=8) as eng:
        drafted, accepted = compare(eng, smol_prompts(), SAMPLED)
        print(f"\nngram, sampled: {accepted}/{drafted} drafts accepted")
        assert accepted > 10                   # speculation did take tokens
        # log-probabilities of verify rows too, on text the drafter keeps matching (a match
        # that lasts one token is not drafted while plain steps run overlapped)
        counting = eng.text_prompt_ids("one two three four five six one two three four five "
                                       "six one two three four five six one two")
        d, a = compare(eng, [counting], {"t0.7": SAMPLED["t0.7-k40-p0.95"]}, top_logprobs=3)
        assert d > 0


def test_sampled_speculation_equals_plain_sampling_model_drafter(requantized):
    # a full q8_0 copy: it agrees with the target's argmax almost everywhere (README), so
    # its greedy chain is often the sampled token too (a 4-block copy almost never is)
    draft = requantized("smollm2", "q8_0")
    with engine("smollm2", drafter="model", draft_model=str(draft), verify_width=6) as eng:
        configs = {k: SAMPLED[k] for k in ("t0.4-k10-p0.8", "t0.8-penalty")}
        drafted, accepted = compare(eng, smol_prompts()[:2], configs)
        print(f"\nq8_0 self-drafter, sampled: {accepted}/{drafted} drafts accepted")
        assert accepted > 0.3 * drafted


def test_sampled_speculation_equals_plain_sampling_tiny_self_drafter():
    with self_drafting("tiny-qwen3", verify_width=16) as eng:
        prompts = [[1, 5, 9, 20, 5, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11], [700, 2, 700, 2]]
        configs = {f"{k}-seed{s}": SamplingParams(**{**vars(p), "seed": s})
                   for k, p in SAMPLED.items() for s in (11, 12)}
        drafted, accepted = compare(eng, prompts, configs)
        print(f"\ntiny self-drafter, sampled: {accepted}/{drafted} drafts accepted")
        assert accepted > 0.2 * drafted        # its greedy chain often is the sampled token


def test_sampled_tree_verify_equals_plain_sampling_tiny_self_drafter():
    """Tree verify with sampled requests: each node's row draws as plain sampling would draw
    the token at its depth, and the path follows the child equal to the draw, so the output
    is plain seeded sampling's; requests with a repetition penalty verify chains."""
    with self_drafting("tiny-qwen3", verify_width=16, tree_budget=8) as eng:
        prompts = [[1, 5, 9, 20, 5, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11], [700, 2, 700, 2]]
        configs = {f"{k}-seed{s}": SamplingParams(**{**vars(p), "seed": s})
                   for k, p in SAMPLED.items() for s in (21, 22)}
        drafted, accepted = compare(eng, prompts, configs)
        print(f"\ntiny self-drafter, tree budget 8, sampled: {accepted}/{drafted} drafts "
              f"accepted, {eng.stats.kv_moves} KV rows moved")
        assert accepted > 0.2 * drafted
        assert eng.stats.kv_moves > 0          # accepted paths left the leading chain


# ------------------------------------------------------------------ the acceptance rule
N_DRAWS, TOP_K = 3000, 6


def test_acceptance_through_the_runner_keeps_the_distribution():
    """One context, the draft x = the most likely token: N verify steps [seed, x] through the
    model runner with request seeds 0..N-1; the token each step emits first (x when accepted,
    else the row's draw) must follow the target distribution p of row 0 (chi-square), and
    x must be accepted exactly when the row's draw is x. A biased rule (accept x with an
    independent uniform below p(x), else take the draw) fails the same test."""
    tr = build_model("tiny-qwen3", CpuBackend(threads=1), max_tokens=16, max_logits=16)
    runner = ModelRunner(tr, 1, 64)
    prompt = [100, 200, 300, 400]               # top 6 at temperature 3: 0.02 .. 0.44
    n = len(prompt)
    logits = np.array(tr.forward(np.asarray(prompt, np.int32), positions_for(0, n),
                                 np.zeros(n, np.int32), n, 1))[0]       # (V,) row of the seed
    params = SamplingParams(temperature=3.0, top_k=TOP_K, top_p=1.0, min_p=0.0)
    ids, probs = Sampler(params, tr.spec.vocab_size, 0).distribution(logits)
    p = np.zeros(tr.spec.vocab_size)
    p[ids] = probs
    x = int(np.argmax(p))
    assert np.count_nonzero(p * N_DRAWS >= 50) == TOP_K     # every cell is well populated
    t = 5                                       # the token index the seed row decides
    seed_tok = prompt[-1]
    tr.forward(np.asarray(prompt[:-1], np.int32), positions_for(0, n - 1),
               np.zeros(n - 1, np.int32), n - 1, 0)                     # KV of the context
    first, biased = [], []
    for s in range(N_DRAWS):
        rows = [RowSampling.of(params, s, t + i, -1) for i in range(2)]
        out = runner.step(StepInput([seed_tok, x], [n - 1, n], [0, 0], [0, 1], rows))
        got = [int(v) for v in out.token_ids]
        n_acc, emitted = accept_chain([seed_tok, x], got)
        assert (n_acc == 2) == (got[0] == x)
        first.append(emitted[0])
        u = counter_uniform(s, ACCEPT_STREAM + t)
        biased.append(x if u < p[x] else got[0])
    first, biased = np.asarray(first), np.asarray(biased)
    pv = chi2_pvalue(first, p)
    print(f"\np(x) = {p[x]:.3f}, accepted {np.mean(first == x):.3f}, p-value {pv:.3g}, "
          f"biased p-value {chi2_pvalue(biased, p):.3g}")
    assert pv >= P_PASS
    assert chi2_pvalue(biased, p) < P_FAIL


# ------------------------------------------------------------------ profile and usage
@pytest.mark.parametrize("profile", [False, True])
def test_step_profile_and_tokens_per_step(profile):
    with self_drafting("tiny-qwen3", verify_width=8, step_profile=profile) as eng:
        for spec in (False, True):
            out = run(eng, [1, 5, 9, 20, 5, 9], SamplingParams(temperature=0.5, seed=3),
                      max_new_tokens=40, ignore_eos=True, speculative=spec)
            u, t = out.finished.usage, out.finished.timings
            assert out.finished.reason is FinishReason.LENGTH
            # every token after the first came from a decode step: seed + accepted drafts
            assert u.completion_tokens - 1 == u.decode_steps + u.accepted_draft_tokens
            assert u.mean_tokens_per_step == pytest.approx(
                (u.completion_tokens - 1) / u.decode_steps)
            assert (u.mean_tokens_per_step > 1.0) == spec
            parts = (t.draft_ms, t.heads_ms, t.verify_ms, t.other_ms)
            if not profile:
                assert parts == (0.0, 0.0, 0.0, 0.0)
                continue
            assert t.verify_ms > 0 and t.heads_ms > 0 and t.other_ms > 0
            assert (t.draft_ms > 0) == spec
            # the decode steps lie between the first and the last token
            assert sum(parts) <= t.decode_ms + 5.0
            assert sum(parts) >= 0.5 * t.decode_ms
