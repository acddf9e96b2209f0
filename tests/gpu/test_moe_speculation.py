"""Speculation on MoE targets on the CUDA backend (tests/engine/test_moe_speculation.py's
identities): the tiny qwen3moe and Laguna files, and a synthetic `tiny-moe` file at Q4_K_M
(K-quant expert GEMVs; made at test time, a few MB), with drafting in full on captured steps.

Greedy output with speculation equals plain greedy output for the n-gram and model drafters at
verify widths 4, 6 and 16, and the width-16 verify steps ran as captured CUDA graphs; seeded
sampled speculation equals plain sampling; a request alone equals it in a batch of four
speculating requests; each token the CUDA engine chose is the CPU backend's (rounding
activations the GPU's way) choice on the same history wherever both top-2 gaps are clear; and
rows of 6- and 16-row steps equal one-row steps bit for bit."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from tests.engine.test_moe_speculation import (
    ARCH,
    MODEL_DRAFTS,
    PROMPTS,
    batch_equals_alone,
    compare_sampled,
)
from tests.support.engines import Engine, run, running_engine
from tests.support.models import TINY, build_model, forward_host
from tests.support.near_ties import logprob_gap, top2_gap

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

WIDTHS = (4, 6, 16)
N_NEW = 40
CLEAR_GAP = 1.0          # tests/golden/test_moe_oracle.py's
SYNTH = "synth-tiny-moe"
NGRAM_TARGETS = ("tiny-qwen3moe-s-q8", "tiny-laguna-q8", "tiny-laguna-elem-q5", SYNTH)
MODEL_TARGETS = (*sorted(MODEL_DRAFTS), SYNTH)
# per architecture (tests/engine's ARCH) plus the synthetic file: (n-gram target, model target)
PAIRS = {**ARCH, "synth": (SYNTH, SYNTH)}
# The synthetic file's prompts: two of PROMPTS and two whose greedy continuations (on the CPU,
# no top-2 gap under 0.05) repeat tokens of their history, for n-gram drafts that are right
SYNTH_PROMPTS = (*PROMPTS[:2], [391, 821, 625, 339], [91, 891, 358, 115, 887, 905, 601, 377, 465])


def prompts_of(path: str) -> tuple:
    return SYNTH_PROMPTS if "tiny-moe" in path else PROMPTS


@pytest.fixture(scope="module")
def files(tmp_path_factory, requantized) -> dict[str, tuple[str, str]]:
    """target -> (its file, its model drafter's file). The synthetic one: the `tiny-moe`
    preset (qwen3moe: 8 experts, 2 used, hidden 256) at Q4_K_M with the oracle fixtures'
    weight spread (0.25, logits with clear choices), drafted for by its q8_0 re-encoding."""
    from service.tools.synth import synthesize

    synth = synthesize(tmp_path_factory.mktemp("moe-spec") / "tiny-moe-q4_k_m.gguf", "tiny-moe",
                       "Q4_K_M", seed=3, weight_std=0.25).path
    out = {SYNTH: (str(synth), str(requantized(synth, "q8_0")))}
    for target in NGRAM_TARGETS[:-1]:
        out[target] = (str(TINY / f"{target}.gguf"), "")
    for target, (mode, layers) in MODEL_DRAFTS.items():
        out[target] = (str(TINY / f"{target}.gguf"),
                       str(requantized(TINY / f"{target}.gguf", mode, layers)))
    return out


def cuda_engine(path: str, **options):
    """A CUDA engine with captured steps, verify width 16, drafting in full."""
    return running_engine(path, **{"backend": "cuda", "n_ctx": 256, "n_slots": 1,
                                   "verify_width": 16, "cuda_graphs": True, **options},
                          draft_in_full=True)


def greedy_at_widths(eng: Engine, prompts) -> tuple[list, dict[int, tuple[int, int]]]:
    """The plain greedy runs per prompt (with top-2 log-probabilities), and (drafted, accepted)
    per width, every speculating run's ids equal to the plain one's."""
    plain = [run(eng, p, max_new_tokens=N_NEW, ignore_eos=True, speculative=False,
                 top_logprobs=2) for p in prompts]
    counts = {}
    for width in WIDTHS:
        eng.config = replace(eng.config, verify_width=width)
        drafted = accepted = 0
        for i, prompt in enumerate(prompts):
            out = run(eng, prompt, max_new_tokens=N_NEW, ignore_eos=True)
            assert out.token_ids == plain[i].token_ids, (width, i)
            drafted += out.finished.usage.draft_tokens
            accepted += out.finished.usage.accepted_draft_tokens
        counts[width] = (drafted, accepted)
    return plain, counts


def verify_graphs(eng: Engine, since: dict) -> dict[tuple[int, int], int]:
    """(tokens, logits rows) of the captured steps that verified drafts (> 1 logits row) ->
    how many times they were replayed after the `since` counts (the engine captures every
    shape at its start and times some: a replay since is a step the requests ran)."""
    out: dict[tuple[int, int], int] = {}
    for k, n in eng.model.backend.graph_replays.items():
        if isinstance(k[1], int) and len(k) > 2 and k[2] != "chain" and k[1] > 1:
            out[(k[0], k[1])] = out.get((k[0], k[1]), 0) + n - since.get(k, 0)
    return out


@pytest.mark.parametrize("target", NGRAM_TARGETS)
def test_ngram_speculation_equals_plain_greedy_on_cuda(target, files):
    path, _ = files[target]
    with cuda_engine(path, drafter="ngram", ngram_size=1) as eng:
        _, counts = greedy_at_widths(eng, prompts_of(path))
    print(f"\n{target} ngram 1 on CUDA: (drafted, accepted) per width {counts}")
    assert all(d > 0 for d, _ in counts.values()), counts
    # acceptance is printed, not asserted: these random-weight files rarely repeat themselves on
    # CUDA's rounding (the H200 accepted none of 49 drafts on two of the targets)


@pytest.mark.parametrize("target", MODEL_TARGETS)
def test_model_drafter_speculation_equals_plain_greedy_on_cuda(target, files):
    """Widths 4, 6 and 16 with the q8_0 copy drafting; verify steps of 16 rows (15 drafts in
    full) ran as replayed graphs; the tokens the engine chose are the CPU backend's choices
    on the same history where the CPU's choice is clear."""
    path, draft = files[target]
    with cuda_engine(path, drafter="model", draft_model=draft) as eng:
        start = eng.model.backend.graph_replays
        plain, counts = greedy_at_widths(eng, prompts_of(path))
        graphs = verify_graphs(eng, start)
    print(f"\n{target} model drafter on CUDA: (drafted, accepted) per width {counts}; "
          f"verify steps replayed {sorted(graphs.items())}")
    assert all(d > 0 and a > 0 for d, a in counts.values()), counts
    assert any(t == 16 and n > 0 for (t, _), n in graphs.items()), graphs
    assert_clear_choices_agree_with_the_cpu(path, plain)


def assert_clear_choices_agree_with_the_cpu(path: str, plain: list) -> None:
    """Each prompt's CUDA greedy ids teacher-forced through the CPU backend (GPU activation
    rounding): where both the CPU's and CUDA's top-2 gaps are clear, the CPU's argmax is the
    token CUDA chose. (These random-weight models amplify rounding: the CPU's two rounding
    modes already differ at gaps of up to ~2 on one side, never at gaps clear on both.)"""
    compared = 0
    for prompt, out in zip(prompts_of(path), plain, strict=True):
        ids = list(prompt) + out.token_ids
        tr = build_model(path, CpuBackend(act_quant="gpu"), n_ctx=128, max_tokens=len(ids))
        logits = forward_host(tr, ids[:-1], 0, len(ids) - 1)[len(prompt) - 1:]
        clear = np.array([top2_gap(r) for r in logits]) >= CLEAR_GAP
        clear &= np.array([logprob_gap(lp) for lp in out.logprobs]) >= CLEAR_GAP
        np.testing.assert_array_equal(logits.argmax(1)[clear], np.array(out.token_ids)[clear])
        compared += int(clear.sum())
    assert compared >= len(plain) * N_NEW // 8, compared


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("arch", sorted(PAIRS))
def test_sampled_speculation_equals_plain_sampling_on_cuda(arch, drafter, files):
    path, draft = files[PAIRS[arch][drafter == "model"]]
    extra = {"draft_model": draft} if drafter == "model" else {"ngram_size": 1}
    with cuda_engine(path, drafter=drafter, verify_width=6, **extra) as eng:
        drafted, accepted = compare_sampled(eng)
    print(f"\n{arch} {drafter}, sampled on CUDA: {accepted}/{drafted} drafts accepted")
    # (the n-gram drafter's sampled drafts are rarely right on these models: 1 of 75 on the
    # CPU for Laguna, so that none is accepted on CUDA's draws is no failure)
    assert drafted > 0 and (accepted > 0 or drafter == "ngram")


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("arch", sorted(PAIRS))
def test_a_request_alone_equals_it_in_a_speculating_batch_on_cuda(arch, drafter, files):
    path, draft = files[PAIRS[arch][drafter == "model"]]
    extra = {"draft_model": draft} if drafter == "model" else {"ngram_size": 1}
    with cuda_engine(path, drafter=drafter, n_slots=4, verify_width=16, **extra) as eng:
        got = batch_equals_alone(eng, drafter)
    if drafter == "model":
        assert sum(g.finished.usage.accepted_draft_tokens for g in got) > 0


@pytest.mark.parametrize("target", NGRAM_TARGETS)
def test_rows_of_verify_sized_steps_equal_one_row_steps_on_cuda(target, files):
    """What the identities rest on, on CUDA: 48 ids fed one per step and in steps of 6 and 16
    rows (the engine's backend options: steps of up to 64 rows invariant) give the same logits
    bit for bit (device routing, gathered expert GEMVs, combine, sliding windows)."""
    from service.backends import create_backend
    from service.config.schema import MAX_STEP_ROWS
    from tests.support.models import teacher_forced

    ids = [(37 * i + 11) % 512 for i in range(48)]
    tr = build_model(files[target][0], create_backend("cuda", graphs=False,
                                                      invariant_tokens=MAX_STEP_ROWS),
                     n_ctx=64, max_tokens=48)
    one = teacher_forced(tr, ids, 1)
    for chunk in (6, 16):
        np.testing.assert_array_equal(teacher_forced(tr, ids, chunk), one, err_msg=str(chunk))
