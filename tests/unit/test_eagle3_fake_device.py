"""The eagle3 drafter through the engine on the fake CUDA device (tests/support/fake_cupy.py):
tiny-qwen3 with captured steps and a synthetic F16 or Q8_0 head, a greedy request of a
299-token prompt (prefill chunks of 128 rows) drafting at width 4 and with trees of 6 nodes.
The fake device checks every launch against the compiled kernels' signatures and raises on
what breaks a captured step (allocation, host reads, another stream), so the drafter's ops
between steps (encode, decode, head, argmax, the row copies and uploads) are checked on the
CUDA backend's code path; the kernels do not compute, so no token is compared here
(tests/gpu/test_eagle3_drafter.py does that on the H200)."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from service.engine.spec.eagle3_drafter import Eagle3Drafter
from service.tools.synth_eagle3 import synthesize_eagle3
from tests.support.cuda_steps import fake_device_engine, speculate_greedily
from tests.support.models import TINY


@pytest.mark.parametrize("quant", ["F16", "Q8_0"])
@pytest.mark.parametrize("tree_budget", [0, 6])
def test_the_eagle3_drafter_drafts_on_the_fake_device(compiled, tmp_path, tree_budget, quant):
    head = synthesize_eagle3(tmp_path / "e3.gguf", TINY / "tiny-qwen3.gguf", layers=(1, 2, 3),
                             quant=quant).path
    with fake_device_engine(
            compiled, n_ctx=512, prefill_chunk=128, verify_width=4, drafter="eagle3",
            draft_model=str(head), tree_budget=tree_budget,
            draft_in_full=True) as (dev, eng):          # verify_alpha 0: draft every step
        assert isinstance(eng.drafter, Eagle3Drafter)
        with capture_logs() as logs:
            fin = speculate_greedily(eng, 6)
    # every extend ran: the 128-row prefill chunks' fc (128 x 768) fits the backend's
    # scratch, sized again once the head's weights were loaded
    assert not [e for e in logs if e["event"] == "drafter_extend_failed"], logs
    assert fin.usage.draft_tokens > 0 and eng.drafter.steps > 0
    assert dev.graphs and all(g.replays for g in dev.graphs)
    launched = {x.kernel for x in dev.launches}
    # the drafter's own: its argmax (chains) and the copies of its kept output rows
    assert {"argmax_rows", "copy_rows"} <= launched, sorted(launched)


@pytest.mark.parametrize("quant,vocab", [("F16", 0), ("Q8_0", 300)])
def test_the_draft_chain_is_one_captured_graph_on_the_fake_device(compiled, tmp_path, quant,
                                                                  vocab):
    """With captured steps the drafter chains on the device (eagle3_chain.py): after the
    prompt's eager first chain, each draft of 3 (verify width 4: a held boundary of the
    accepted rows and 2 chained steps) is one backend step keyed (rows, 1, "eagle3-chain", 3),
    captured once and replayed (the fake kernels choose id 0 everywhere, so every draft is
    accepted and the boundary is 4 rows), with no capture-rule violation; the heads: F16 full
    vocabulary, and Q8_0 with d2t on the target's embeddings (the gathered draft-row table)."""
    head = synthesize_eagle3(tmp_path / "e3.gguf", TINY / "tiny-qwen3.gguf", layers=(1, 2, 3),
                             quant=quant, draft_vocab=vocab).path
    with fake_device_engine(compiled, n_ctx=512, prefill_chunk=128, verify_width=4,
                            drafter="eagle3", draft_model=str(head), cuda_graphs=True,
                            draft_in_full=True) as (dev, eng):
        d = eng.drafter
        assert isinstance(d, Eagle3Drafter) and d.chain is not None
        with capture_logs() as logs:
            fin = speculate_greedily(eng, 32)
        graphs = eng.model.backend._steps.graphs
        chains = [(k, g.graph) for k, (g, _) in graphs.items() if k[2:3] == ("eagle3-chain",)]
    assert not [e for e in logs if e["event"] == "drafter_extend_failed"], logs
    assert d.chain.steps >= 3 and fin.usage.draft_tokens > 0
    assert chains and all(k[3] == 3 and 1 <= k[0] <= 4 for k, _ in chains), chains
    # per key: an eager run, the capture (launched once), then replays
    assert sum(g.replays for _, g in chains) >= 2, chains
    kernels = [n.kernel for _, g in chains for n in g.nodes if hasattr(n, "kernel")]
    assert kernels.count("argmax_rows") == 3 * len(chains), kernels


def test_the_gpu_tests_chain_and_eager_drafters_run_on_the_fake_device(compiled, tmp_path):
    """tests/gpu/test_eagle3_chain.py's drive (prefill, proposals, reruns, tree candidates,
    verify steps, extends) with the captured chain and with an eager drafter on the same head,
    a reduced vocabulary on the target's embeddings: it runs on the CUDA backend's code path
    without a capture-rule violation (the kernels do not compute: no draft is compared)."""
    from tests.engine.test_eagle3_chain import drive

    head = synthesize_eagle3(tmp_path / "e3.gguf", TINY / "tiny-qwen3.gguf", layers=(1, 2, 3),
                             quant="F16", draft_vocab=200).path
    with fake_device_engine(compiled, n_ctx=256, n_slots=1, verify_width=16, drafter="eagle3",
                            draft_model=str(head), cuda_graphs=True, start=False) as (dev, eng):
        chained = eng.drafter
        eager = Eagle3Drafter(chained.model, chained.model_name, graph_chain=False)
        ks = [1, 2, 4, 6, 3, 4, 4, 4]
        assert len(drive(eager, eng.runner, list(range(3, 14)), ks)) > len(ks)
        drive(chained, eng.runner, list(range(3, 14)), ks)
        assert chained.chain.steps >= len(ks) and eager.chain is None
    assert any(g.replays for g in dev.graphs)
