"""The overlapped decode loop on CUDA (service/engine/overlap.py; `overlap` auto is on there):
streams token for token equal to the one-step loop's, greedy and sampled (the penalty reading
the history the captured step records), alone and in a batch whose members stop at different
steps (by length and by stop id), with log-probabilities; the fed steps really ran. Tiny
fixture models, so it runs without the real models."""

from __future__ import annotations

import pytest

from service.engine.types import GenerationRequest, SamplingParams, StoppingCriteria
from tests.gpu.test_models import cuda_engine
from tests.support.batching import same_output, sampled, together

pytestmark = pytest.mark.gpu


def requests(stop_ids: list[int] | None = None) -> list[GenerationRequest]:
    out = []
    for i in range(6):
        sampling = SamplingParams(temperature=0.0) if i % 2 == 0 else sampled(i)
        stops = (stop_ids[i],) if stop_ids and i < 3 else ()
        out.append(GenerationRequest(
            f"o{i}", tuple(range(3 + i, 20 + 2 * i)), sampling,
            StoppingCriteria(max_new_tokens=12 + 5 * i, stop_token_ids=stops, ignore_eos=True),
            speculative=False, top_logprobs=2 if i == 1 else 0))
    return out


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama-mixq"])
def test_overlapped_loop_streams_what_the_one_step_loop_streams_on_cuda(model):
    with cuda_engine(model, n_slots=8, overlap="on") as on, \
            cuda_engine(model, n_slots=8, overlap="off") as off:
        fed = 0
        inner = on.runner.submit

        def submit(inp, feed=None, *rest, **kw):
            nonlocal fed
            fed += feed is not None
            return inner(inp, feed, *rest, **kw)

        on.runner.submit = submit
        free, _ = together(off, requests())
        stop_ids = [r.token_ids[6] for r in free]          # each stops inside the overlap
        reqs = requests(stop_ids)
        got, _ = together(on, reqs)
        ref, _ = together(off, reqs)
        bad = [(a.token_ids, b.token_ids) for a, b in zip(got, ref, strict=True)
               if not same_output(a, b)]
        assert not bad
        assert fed >= 20, f"only {fed} fed steps"
        assert all(r.token_ids[-1] == s for r, s in zip(got[:3], stop_ids, strict=False))
