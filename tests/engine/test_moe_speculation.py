"""Speculation on MoE targets, on the CPU: the tiny qwen3moe and Laguna files (softmax and sigmoid
routers, a shared expert, sliding-window layers of window 8 that a 16-row verify step spans,
per-head and per-element attention gates).

With drafts really verified (drafting in full, so the machine's measured verify cost does not
decide how much is drafted), greedy output with speculation equals plain greedy output for the
n-gram drafter (n-gram lengths 1 and 2) and the model drafter (a q8_0 re-encoding of the
target, or of its first four blocks, made by service.tools.quantize) at verify widths 4, 6 and
16; seeded sampled speculation equals plain seeded
sampling; and a speculating request's output alone equals its output in a batch of four
speculating requests. What these rest on, a row of a verify step computed as a one-row step
computes it, is tests/golden/test_moe_oracle.py::test_a_rows_logits_do_not_depend_on_the_step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.config import EngineConfig
from service.engine.spec.draft_model import ModelDrafter
from service.engine.types import GenerationRequest, SamplingParams, StoppingCriteria
from tests.support.batching import alone, same_output, together
from tests.support.engines import GREEDY, Engine, run, running_engine
from tests.support.models import TINY

TARGETS = ("tiny-qwen3moe-s-q8", "tiny-laguna-q8", "tiny-laguna-elem-q5")
# Model drafter targets -> their drafts: (re-encoding, blocks kept; None: all). The fixture
# files of one architecture have different weights (other seeds), and these random-weight
# models amplify rounding (a q4_0 copy's greedy ids differ from the first), so the drafts are
# q8_0 copies: of the f16 file (its greedy ids for a while), of the q5_1 file (a few), and the
# first four of tiny-laguna-q8's five blocks.
MODEL_DRAFTS = {"tiny-qwen3moe-s-f16": ("q8_0", None), "tiny-laguna-elem-q5": ("q8_0", None),
                "tiny-laguna-q8": ("q8_0", 4)}
# per architecture: the n-gram drafter's target and the model drafter's
ARCH = {"qwen3moe": ("tiny-qwen3moe-s-q8", "tiny-qwen3moe-s-f16"),
        "laguna": ("tiny-laguna-q8", "tiny-laguna-elem-q5")}
WIDTHS = (4, 6, 16)
N_NEW = 40
# Prompts of the 512-token vocabulary whose greedy continuations on these files repeat tokens
# and token pairs of their history (picked from random prompts by that count alone), so the
# n-gram drafter's drafts are sometimes right.
PROMPTS = ([279, 451, 350, 323, 107, 96, 484], [9, 377, 113, 211, 146, 96, 472],
           [110, 399, 110, 399], [63, 389, 128, 478, 422, 485, 239])
SAMPLED = {
    "t0.8-k40-p0.95": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, seed=11),
    "t0.5-penalty": SamplingParams(temperature=0.5, top_k=20, repetition_penalty=1.3,
                                   repeat_last_n=16, seed=13),
}


def path(name: str) -> str:
    return str(TINY / f"{name}.gguf")


def engine(target: str, **overrides):
    """`target` with verify width 16 (any narrower width is set per run through the config),
    drafting in full."""
    return running_engine(path(target), **{"verify_width": 16, **overrides},
                          draft_in_full=True)


@pytest.fixture(scope="module")
def drafts(requantized) -> dict[str, str]:
    """target -> the path of its draft file (MODEL_DRAFTS)."""
    return {t: str(requantized(path(t), mode, layers))
            for t, (mode, layers) in MODEL_DRAFTS.items()}


def model_engine(target: str, drafts: dict[str, str], **overrides):
    return engine(target, drafter="model", draft_model=drafts[target], **overrides)


def arch_engine(arch: str, drafter: str, drafts: dict[str, str], **overrides):
    """The n-gram drafter (n-gram length 1) on ARCH[arch]'s first target, or the model drafter
    on its second."""
    if drafter == "model":
        return model_engine(ARCH[arch][1], drafts, **overrides)
    return engine(ARCH[arch][0], drafter="ngram", ngram_size=1, **overrides)


_PLAIN: dict[tuple[str, int], list[int]] = {}


def plain_greedy(eng: Engine, target: str, i: int) -> list[int]:
    """Greedy ids of PROMPTS[i] on `target` without speculation (once per run)."""
    key = (target, i)
    if key not in _PLAIN:
        out = run(eng, PROMPTS[i], max_new_tokens=N_NEW, ignore_eos=True, speculative=False)
        assert out.finished.usage.draft_tokens == 0
        _PLAIN[key] = out.token_ids
    return _PLAIN[key]


def greedy_at_widths(eng: Engine, target: str) -> dict[int, tuple[int, int]]:
    """Every prompt at every width equals plain greedy; (drafted, accepted) per width."""
    counts = {}
    for width in WIDTHS:
        eng.config = replace(eng.config, verify_width=width)
        drafted = accepted = 0
        for i, prompt in enumerate(PROMPTS):
            out = run(eng, prompt, max_new_tokens=N_NEW, ignore_eos=True)
            assert out.token_ids == plain_greedy(eng, target, i), (target, width, i)
            u = out.finished.usage
            drafted, accepted = drafted + u.draft_tokens, accepted + u.accepted_draft_tokens
        counts[width] = (drafted, accepted)
    return counts


# n-gram length 1 only: it drafts most often (length 2 verified the same rows less often and
# doubled the CI time of this file)
@pytest.mark.parametrize("ngram", [1])
@pytest.mark.parametrize("target", TARGETS)
def test_ngram_speculation_equals_plain_greedy(target, ngram):
    with engine(target, drafter="ngram", ngram_size=ngram) as eng:
        counts = greedy_at_widths(eng, target)
    print(f"\n{target} ngram {ngram}: (drafted, accepted) per width {counts}")
    for width, (drafted, accepted) in counts.items():
        assert drafted > 0, (width, counts)
        if ngram == 1:          # a one-token match drafts often enough to be accepted too
            assert accepted > 0, (width, counts)
    assert sum(a for _, a in counts.values()) > 0


@pytest.mark.parametrize("target", sorted(MODEL_DRAFTS))
def test_model_drafter_speculation_equals_plain_greedy(target, drafts):
    """A q8_0 copy drafts for the target at widths 4, 6 and 16; the f16 file's copy has most
    of its drafts accepted (long chains of 16-row verify steps)."""
    with model_engine(target, drafts) as eng:
        assert isinstance(eng.drafter, ModelDrafter)
        counts = greedy_at_widths(eng, target)
    print(f"\n{target} drafted by {MODEL_DRAFTS[target]}: (drafted, accepted) per width "
          f"{counts}")
    for width, (drafted, accepted) in counts.items():
        assert drafted > 0 and accepted > 0, (width, counts)
        if target == "tiny-qwen3moe-s-f16":
            assert accepted > 0.5 * drafted, (width, counts)
    # width 16 verified deeper chains: more drafts than at width 6
    assert counts[16][0] > counts[6][0]


def compare_sampled(eng: Engine) -> tuple[int, int]:
    """Every prompt under every seeded config, speculating and plain: the same tokens, text and
    log-probabilities. (drafted, accepted) over the speculating runs."""
    drafted = accepted = 0
    for name, params in SAMPLED.items():
        for i, prompt in enumerate(PROMPTS):
            kw = {"max_new_tokens": 32, "ignore_eos": True, "top_logprobs": 2}
            plain = run(eng, prompt, params, speculative=False, **kw)
            spec = run(eng, prompt, params, speculative=True, **kw)
            assert spec.token_ids == plain.token_ids, (name, i)
            assert spec.text == plain.text and spec.logprobs == plain.logprobs, (name, i)
            assert spec.started.seed == plain.started.seed == params.seed
            drafted += spec.finished.usage.draft_tokens
            accepted += spec.finished.usage.accepted_draft_tokens
    return drafted, accepted


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("arch", sorted(ARCH))
def test_sampled_speculation_equals_plain_sampling(arch, drafter, drafts):
    with arch_engine(arch, drafter, drafts, verify_width=6) as eng:
        drafted, accepted = compare_sampled(eng)
    print(f"\n{arch} {drafter}, sampled: {accepted}/{drafted} drafts accepted")
    assert drafted > 0 and accepted > 0


def batch_requests(kind: str) -> list[GenerationRequest]:
    """Four speculating requests of different prompts and lengths (request 0 greedy, 1 seeded
    sampling, 2 greedy with a penalty, 3 seeded at another temperature)."""
    params = [GREEDY, SAMPLED["t0.8-k40-p0.95"],
              SamplingParams(temperature=0.0, repetition_penalty=1.2, repeat_last_n=8),
              SAMPLED["t0.5-penalty"]]
    return [GenerationRequest(f"{kind}-{i}", tuple(PROMPTS[i]), params[i],
                              StoppingCriteria(max_new_tokens=24 + 6 * i, ignore_eos=True),
                              speculative=True, top_logprobs=1 if i % 2 else 0)
            for i in range(4)]


def batch_equals_alone(eng: Engine, drafter: str) -> list:
    """batch_requests(drafter) together on `eng` equal each alone (tokens, text,
    log-probabilities), four at once, drafts verified; the batch's results."""
    reqs = batch_requests(drafter)
    ref = [alone(eng, r) for r in reqs]
    got, stats = together(eng, reqs)
    bad = [(r.request_id, a.token_ids, b.token_ids)
           for r, a, b in zip(reqs, got, ref, strict=True) if not same_output(a, b)]
    assert not bad
    assert stats.max_sequences == 4
    assert sum(g.finished.usage.draft_tokens for g in got) > 0
    return got


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("arch", sorted(ARCH))
def test_a_request_alone_equals_it_in_a_speculating_batch(arch, drafter, drafts):
    """Verify rows of four sequences share each step (up to 4 x 6 rows): the tokens, text and
    log-probabilities of every request equal its run alone."""
    with arch_engine(arch, drafter, drafts, n_slots=4, verify_width=6) as eng:
        got = batch_equals_alone(eng, drafter)
    assert sum(g.finished.usage.accepted_draft_tokens for g in got) > 0


@pytest.mark.parametrize("target", sorted(MODEL_DRAFTS))
def test_width_16_is_accepted_on_moe_targets(target, drafts):
    """Config validation takes the widest verify step on MoE files, for both drafters; the
    engine's step sizes reach 16 rows."""
    for drafter, extra in (("ngram", {}), ("model", {"draft_model": drafts[target]})):
        cfg = EngineConfig(backend="cpu", n_ctx=256, n_slots=1, verify_width=16,
                           drafter=drafter, **extra)
        assert cfg.problems() == []
    with model_engine(target, drafts, start=False) as eng:
        assert eng.config.verify_width == 16
        assert eng.spec.moe is not None
        assert 16 in eng.model.backend.step_sizes(16)


@pytest.mark.parametrize("target", ["tiny-qwen3moe-s-q8", "tiny-laguna-q8",
                                    "tiny-laguna-elem-q5"])
def test_rows_of_steps_up_to_the_engines_limit_equal_one_row_steps(target):
    """The engine's CPU backend keeps steps of up to MAX_STEP_ROWS (64) rows invariant (a
    batch of four 16-row verify steps is one step): 48 ids fed one per step, in 16-row steps
    and in one 48-row step give the same logits bit for bit (routing, combine, shared expert,
    sliding windows of 8 row by row); a backend invariant only to 16 rows does not (the
    48-row step's sgemm rounds otherwise), so the comparison can tell."""
    import numpy as np

    from service.backends.cpu.backend import CpuBackend
    from service.config.schema import MAX_STEP_ROWS
    from tests.support.models import build_model, teacher_forced

    ids = [(37 * i + 11) % 512 for i in range(48)]

    def rows(invariant: int, chunk: int) -> np.ndarray:
        tr = build_model(path(target), CpuBackend(invariant_tokens=invariant), n_ctx=64,
                         max_tokens=48)
        return teacher_forced(tr, ids, chunk)

    one = rows(MAX_STEP_ROWS, 1)
    np.testing.assert_array_equal(rows(MAX_STEP_ROWS, 16), one)
    np.testing.assert_array_equal(rows(MAX_STEP_ROWS, 48), one)
    assert not np.array_equal(rows(16, 48), one)      # the control
