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
from service.engine.types import Finished, GenerationRequest, SamplingParams, StoppingCriteria
from service.tools.synth_eagle3 import synthesize_eagle3
from tests.support.cuda_steps import fake_device_engine
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
        req = GenerationRequest("t", tuple(range(1, 300)), SamplingParams(temperature=0.0),
                                StoppingCriteria(max_new_tokens=6, ignore_eos=True),
                                speculative=True)
        with capture_logs() as logs:
            events = list(eng.generate(req, timeout=120))
    # every extend ran: the 128-row prefill chunks' fc (128 x 768) fits the backend's
    # scratch, sized again once the head's weights were loaded
    assert not [e for e in logs if e["event"] == "drafter_extend_failed"], logs
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.error is None, fin
    assert fin.usage.draft_tokens > 0 and eng.drafter.steps > 0
    assert dev.graphs and all(g.replays for g in dev.graphs)
    launched = {x.kernel for x in dev.launches}
    # the drafter's own: its argmax (chains) and the copies of its kept output rows
    assert {"argmax_rows", "copy_rows"} <= launched, sorted(launched)
