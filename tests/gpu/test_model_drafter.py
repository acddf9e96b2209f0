"""The `model` drafter on the CUDA backend: a full q8_0 copy and a 4-block truncation of
SmolLM2 (made with service.gguf.requant) draft for it with their own backend instance, KV cache
and captured steps; greedy output equals plain greedy output at widths 2, 6 and 16."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.gguf.requant import requantize
from tests.conftest import load_json
from tests.gpu.test_models import cuda_engine, real_path

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layers", [None, 4], ids=["full-q8_0", "4-layers-q8_0"])
def test_model_drafter_is_lossless_on_cuda(tmp_path, layers):
    draft = requantize(real_path("smollm2"), tmp_path / "draft.gguf", "q8_0", layers).path
    eng = cuda_engine("smollm2", drafter="model", draft_model=str(draft), verify_width=16,
                      n_slots=1)
    eng.verify_alpha = 0.0              # draft in full at every width
    assert eng.drafter.model.backend is not eng.model.backend
    try:
        for width in (2, 6, 16):
            eng.config = replace(eng.config, verify_width=width)
            drafted = accepted = 0
            for case in load_json("llamacpp_smollm2_greedy.json")["cases"]:
                plain = _run(eng, case["prompt_ids"], False)
                spec = _run(eng, case["prompt_ids"], None)
                assert spec.token_ids == plain.token_ids, (layers, width, case["name"])
                drafted += spec.finished.usage.draft_tokens
                accepted += spec.finished.usage.accepted_draft_tokens
            print(f"\ndraft layers {layers or 'all'} width {width}: {accepted}/{drafted} "
                  f"accepted ({accepted / max(drafted, 1):.1%})")
            assert drafted > 0
            if layers is None:
                assert accepted > 0.5 * drafted
    finally:
        eng.stop(10)


def _run(eng, ids, speculative):
    from service.engine.types import Collected, GenerationRequest, SamplingParams, StoppingCriteria

    req = GenerationRequest("g", tuple(ids), SamplingParams(temperature=0.0),
                            StoppingCriteria(max_new_tokens=32, ignore_eos=True),
                            speculative=speculative)
    out = Collected()
    for e in eng.generate(req, timeout=300):
        out.add(e)
    return out
