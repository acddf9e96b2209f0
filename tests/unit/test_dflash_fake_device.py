"""The dflash drafter through the engine on the fake CUDA device (tests/support/fake_cupy.py):
tiny-qwen3 with captured steps and a synthetic F16 or Q8_0 DFlash drafter (two decoder layers,
block of 8, one with a reduced draft vocabulary and causal block attention), a greedy request of
a 299-token prompt (prefill chunks of 128 rows, whose tapped rows are injected into the
drafter's cache) drafting at width 4 and with trees of 6 nodes. The fake device checks every
launch against the compiled kernels' signatures and raises on what breaks a captured step
(allocation, host reads, another stream), so the drafter's ops between steps (injection, the
block forward, its attention with attn_lo / attn_mask, the row copies and uploads; DSpark's
Markov chain and confidence head, on two more files, one with DFlash's bonus-anchor layout, a
reduced vocabulary and a markov_w2.scale) are checked on the CUDA backend's code path; the
kernels do not compute, so no token is compared here."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from service.engine.spec.dflash_drafter import DflashDrafter
from service.tools.synth_dflash import DflashOptions, synthesize_dflash
from tests.support.cuda_steps import fake_device_engine, speculate_greedily
from tests.support.models import TINY

FILES = {"F16": DflashOptions(n_layer=2, block_size=8, quant="F16"),
         "Q8_0-reduced-causal": DflashOptions(n_layer=2, block_size=8, quant="Q8_0",
                                              draft_vocab=300, causal=True),
         "DSpark-Q8_0-confidence": DflashOptions(block_size=8, quant="Q8_0", markov_rank=32,
                                                 confidence_head=True),
         "DSpark-F16-bonus-reduced": DflashOptions(block_size=8, quant="F16", markov_rank=16,
                                                   markov_scale=0.5, draft_vocab=300,
                                                   bonus_anchor=True)}


@pytest.mark.parametrize("kind", list(FILES))
@pytest.mark.parametrize("tree_budget", [0, 6])
def test_the_dflash_drafter_drafts_on_the_fake_device(compiled, tmp_path, tree_budget, kind):
    path = synthesize_dflash(tmp_path / "df.gguf", TINY / "tiny-qwen3.gguf", FILES[kind]).path
    with fake_device_engine(
            compiled, n_ctx=512, prefill_chunk=128, verify_width=4, drafter="dflash",
            draft_model=str(path), tree_budget=tree_budget,
            draft_p_min=0.5 if FILES[kind].confidence_head else 0.0,
            draft_in_full=True) as (dev, eng):          # verify_alpha 0: draft every step
        assert isinstance(eng.drafter, DflashDrafter)
        with capture_logs() as logs:
            fin = speculate_greedily(eng, 6)
    assert not [e for e in logs if e["event"].startswith("drafter_")
                and e.get("log_level") in ("error", "warning")], logs
    assert fin.usage.draft_tokens > 0 and eng.drafter.steps > 0
    assert dev.graphs and all(g.replays for g in dev.graphs)


@pytest.mark.parametrize("kind", list(FILES))
def test_the_block_is_one_captured_graph_on_the_fake_device(compiled, tmp_path, kind):
    """With captured steps propose's block (the forward and its picks: the argmax, or DSpark's
    Markov chain) is one backend step keyed (T, 1, "dflash-block", k), captured once per shape
    and replayed, with no capture-rule violation (the confidence cut reads its values after
    the step)."""
    path = synthesize_dflash(tmp_path / "df.gguf", TINY / "tiny-qwen3.gguf", FILES[kind]).path
    with fake_device_engine(
            compiled, n_ctx=512, prefill_chunk=128, verify_width=4, drafter="dflash",
            draft_model=str(path), cuda_graphs=True,
            draft_p_min=0.5 if FILES[kind].confidence_head else 0.0,
            draft_in_full=True) as (dev, eng):
        d = eng.drafter
        assert isinstance(d, DflashDrafter) and d.graph_block
        fin = speculate_greedily(eng, 24)
        graphs = eng.model.backend._steps.graphs
        blocks = [(k, g.graph) for k, (g, _) in graphs.items() if k[2:3] == ("dflash-block",)]
    assert fin.usage.draft_tokens > 0
    assert blocks and sum(g.replays for _, g in blocks) >= 2, blocks
    picks = "argmax_rows"
    for _, g in blocks:
        assert picks in [n.kernel for n in g.nodes if hasattr(n, "kernel")]


def test_the_gpu_tests_blocks_run_on_the_fake_device(compiled, tmp_path):
    """tests/gpu/test_dflash_graph_block.py's drive (prefill, proposals, tree candidates,
    verify steps, extends) with the captured block and with an eager drafter on the same
    DSpark file with the confidence cut: it runs on the CUDA backend's code path without a
    capture-rule violation (the kernels do not compute: no draft is compared)."""
    from tests.engine.test_dflash_graph_block import drive

    path = synthesize_dflash(tmp_path / "df.gguf", TINY / "tiny-qwen3.gguf",
                             FILES["DSpark-Q8_0-confidence"]).path
    with fake_device_engine(compiled, n_ctx=256, n_slots=1, verify_width=16, drafter="dflash",
                            draft_model=str(path), cuda_graphs=True, draft_p_min=0.5,
                            start=False) as (dev, eng):
        one = eng.drafter
        eager = DflashDrafter(one.model, one.model_name, p_min=0.5, graph_block=False)
        ks = [1, 2, 4, 6, 3, 4, 4, 4]
        drive(eager, eng.runner, list(range(3, 14)), ks)
        drive(one, eng.runner, list(range(3, 14)), ks)
        assert one.graph_block and not eager.graph_block
    assert any(g.replays for g in dev.graphs)
