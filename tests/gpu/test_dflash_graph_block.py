"""The dflash drafter's block as one captured graph on CUDA (graph_block; tests/engine/
test_dflash_graph_block.py's checks, on the H200). NOT RUN YET: written without a GPU, checked
here only by collecting it with a stub CuPy; the first `make test-gpu` runs it.

- The block replayed from its CUDA graph (one per (rows, k): the forward and its picks, the
  argmax or DSpark's Markov chain) proposes exactly the drafts of the eager block
  (graph_block=False: the same ops launched one by one) on the same target rows, after a
  prompt and after verify steps accepting some drafts, with tree candidates in between; the
  drafters of tests/gpu/test_dflash_drafter.py (F16; Q8_0 reduced causal; DSpark Q8_0 with the
  confidence cut).
- The engine's greedy output with the captured block (the default with cuda_graphs) equals
  plain greedy output: tests/gpu/test_dflash_drafter.py, whose engines now run it; here a
  key's graph is also checked to exist after a request.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from service.tools.synth_dflash import synthesize_dflash
from tests.engine.test_dflash_drafter import N_NEW, TARGET
from tests.engine.test_dflash_graph_block import drive
from tests.engine.test_moe_speculation import PROMPTS
from tests.gpu.test_dflash_drafter import DRAFTERS, P_MIN, cuda_engine
from tests.support.engines import run
from tests.support.models import model_path

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("dfggpu")
    return {k: synthesize_dflash(d / f"{k}.gguf", model_path(TARGET), o).path
            for k, o in DRAFTERS.items()}


def block_graphs(eng) -> list:
    graphs = eng.model.backend._steps.graphs
    return [k for k in graphs if k[2:3] == ("dflash-block",)]


@pytest.mark.parametrize("which", list(DRAFTERS))
def test_the_replayed_block_proposes_the_eager_blocks_drafts_on_cuda(drafters, which):
    from service.engine.spec.dflash_drafter import DflashDrafter

    prompt = [(41 * i + 3) % 1024 for i in range(11)]
    ks = [1, 2, 4, 6, 3, 5, 7, 2, 4, 4, 4, 2, 2]
    with cuda_engine(drafters[which], start=False) as eng:
        one, runner = eng.drafter, eng.runner
        assert one.graph_block                        # captured steps: the block is captured
        eager = DflashDrafter(one.model, one.model_name, p_min=P_MIN.get(which, 0.0),
                              graph_block=False)
        want = drive(eager, runner, prompt, ks)
        got = drive(one, runner, prompt, ks)
        assert block_graphs(eng)
    assert got == want


@pytest.mark.parametrize("which", list(DRAFTERS))
def test_a_request_with_the_captured_block_equals_plain_on_cuda(drafters, which):
    with cuda_engine() as eng:
        plain = run(eng, PROMPTS[0], max_new_tokens=N_NEW, ignore_eos=True,
                    speculative=False).token_ids
    with cuda_engine(drafters[which]) as eng:
        out = run(eng, PROMPTS[0], max_new_tokens=N_NEW, ignore_eos=True)
        assert out.token_ids == plain
        assert out.finished.usage.draft_tokens > 0 and block_graphs(eng)
