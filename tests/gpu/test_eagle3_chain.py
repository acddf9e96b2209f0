"""The eagle3 drafter's captured draft chain on CUDA (service/engine/spec/eagle3_chain.py;
tests/engine/test_eagle3_chain.py's checks, on the H200). NOT RUN YET: written without a GPU,
checked here only by collecting it with a stub CuPy; the first `make test-gpu` runs it.

- The chain replayed from its CUDA graph (one per (boundary rows, k)) proposes exactly the
  drafts of the eager chain (graph_chain=False: the same ops launched one by one) on the same
  target rows, after a prompt, after verify steps accepting 0..3 drafts, a rerun of the same
  history and tree candidates, and for three slots drafting between shared verify steps; heads
  F16: full vocabulary, and d2t on the target's embeddings.
- The engine with the captured chain (the default with cuda_graphs) gives plain greedy output
  at widths 2, 6 and 16, and a chain's graph was captured.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.engine.test_eagle3_chain import drive
from tests.engine.test_eagle3_drafter import N_NEW, TARGET, WIDTHS
from tests.engine.test_moe_speculation import PROMPTS
from tests.gpu.test_eagle3_drafter import cuda_engine
from tests.support.engines import run
from tests.support.models import model_path

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, Path]:
    from service.tools.synth_eagle3 import synthesize_eagle3

    d, t = tmp_path_factory.mktemp("e3cgpu"), model_path(TARGET)
    return {"random": synthesize_eagle3(d / "random.gguf", t, seed=6, layers=(1, 2, 3),
                                        quant="F16", weight_std=0.1).path,
            "shared": synthesize_eagle3(d / "shared.gguf", t, seed=8, layers=(1, 2, 3),
                                        quant="F16", weight_std=0.1, draft_vocab=200).path}


def chain_graphs(eng) -> list:
    """The captured draft chains' graphs of eng's backend: (key, graph)."""
    graphs = eng.model.backend._steps.graphs
    return [(k, g) for k, (g, _) in graphs.items() if k[2:3] == ("eagle3-chain",)]


@pytest.mark.parametrize("which", ["random", "shared"])
def test_the_replayed_chain_proposes_the_eager_chains_drafts_on_cuda(heads, which):
    from service.engine.spec.eagle3_drafter import Eagle3Drafter

    prompt = [(41 * i + 3) % 1024 for i in range(11)]
    ks = [1, 2, 4, 6, 3, 5, 8, 2, 7, 4, 4, 4, 2, 2]
    with cuda_engine(heads[which], start=False) as eng:
        chained, runner = eng.drafter, eng.runner
        assert chained.chain is not None              # captured steps: the chain is captured
        eager = Eagle3Drafter(chained.model, chained.model_name, graph_chain=False)
        want = drive(eager, runner, prompt, ks)
        got = drive(chained, runner, prompt, ks)
        graphs = chain_graphs(eng)
    assert got == want
    assert graphs and chained.chain.steps >= len(ks)


@pytest.mark.parametrize("which", ["random", "shared"])
def test_greedy_speculation_with_the_captured_chain_equals_plain_on_cuda(heads, which):
    with cuda_engine() as eng:
        plain = [run(eng, p, max_new_tokens=N_NEW, ignore_eos=True,
                     speculative=False).token_ids for p in PROMPTS]
    with cuda_engine(heads[which]) as eng:
        for width in WIDTHS:
            eng.config = replace(eng.config, verify_width=width)
            for prompt, want in zip(PROMPTS, plain, strict=True):
                out = run(eng, prompt, max_new_tokens=N_NEW, ignore_eos=True)
                assert out.token_ids == want, (which, width, prompt)
                assert out.finished.usage.draft_tokens > 0
        assert eng.drafter.chain.steps > 0
        assert chain_graphs(eng)


def test_each_slots_replayed_chain_in_a_batch_proposes_the_eager_drafts_on_cuda(heads):
    """Three sequences in three slots drafting between shared verify steps (drive_batch)."""
    from service.engine.spec.eagle3_drafter import Eagle3Drafter
    from tests.engine.test_eagle3_chain import drive_batch

    prompts = [[(41 * i + 3 + 7 * s) % 1024 for i in range(9 + 2 * s)] for s in range(3)]
    ks = [1, 3, 2, 4, 5, 2, 3, 3, 3]
    with cuda_engine(heads["shared"], start=False, n_slots=3) as eng:
        chained, runner = eng.drafter, eng.runner
        eager = Eagle3Drafter(chained.model, chained.model_name, graph_chain=False)
        want = drive_batch(eager, runner, prompts, ks)
        got = drive_batch(chained, runner, prompts, ks)
    assert got == want
