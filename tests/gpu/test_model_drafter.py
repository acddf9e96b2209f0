"""The `model` drafter on the CUDA backend: a full q8_0 copy and a 4-block truncation of
SmolLM2 (made with service.tools.quantize) draft for it with their own backend instance, KV cache
and captured steps; greedy output equals plain greedy output at widths 2, 6 and 16. The draft
chain is one captured graph per chain length, and the drafts, candidates and log-probabilities
of the captured chain (eager on first use, captured on the second, replayed after) equal those
of the chain on an eager backend and of the chain run step by step, over rounds of partial
acceptance, with and without a Markov head."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from service.backends import create_backend
from tests.engine.test_draft_chain import (
    LENGTHS,
    accept_part,
    draft,
    drafter_on,
    make_draft_files,
)
from tests.engine.test_model_drafter import _State
from tests.gpu.test_models import cuda_engine, real_path
from tests.support.models import load_json

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layers", [None, 4], ids=["full-q8_0", "4-layers-q8_0"])
def test_model_drafter_is_lossless_on_cuda(requantized, layers):
    draft = requantized(real_path("smollm2"), "q8_0", layers)
    with cuda_engine("smollm2", drafter="model", draft_model=str(draft), verify_width=16,
                     n_slots=1, draft_in_full=True) as eng:      # drafts in full at every width
        assert eng.drafter.model.backend is not eng.model.backend
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


def _run(eng, ids, speculative):
    from service.engine.types import Collected, GenerationRequest, SamplingParams, StoppingCriteria

    req = GenerationRequest("g", tuple(ids), SamplingParams(temperature=0.0),
                            StoppingCriteria(max_new_tokens=32, ignore_eos=True),
                            speculative=speculative)
    out = Collected()
    for e in eng.generate(req, timeout=300):
        out.add(e)
    return out


ROUNDS = 3 * len(LENGTHS)       # every length eager, captured, then replayed


@pytest.fixture(scope="module")
def draft_files(requantized, tmp_path_factory):
    return make_draft_files(requantized(real_path("smollm2"), "q8_0", 4),
                            tmp_path_factory.mktemp("chain"))


@pytest.mark.parametrize("n_top", [0, 3], ids=["ids", "candidates"])
@pytest.mark.parametrize("which", ["plain", "head"])
def test_the_captured_chain_equals_eager_and_step_by_step(draft_files, which, n_top):
    head = which == "head"
    graphed = drafter_on(create_backend("cuda", graphs=True, invariant_tokens=16),
                         draft_files[which], head)
    eager = drafter_on(create_backend("cuda", graphs=False, invariant_tokens=16),
                       draft_files[which], head)
    prompt = load_json("llamacpp_smollm2_greedy.json")["cases"][1]["prompt_ids"]   # 18 ids
    one, ref, plain = _State(0, list(prompt)), _State(1, list(prompt)), _State(0, list(prompt))
    graphed.start(one)
    graphed.start(ref)
    eager.start(plain)
    for r in range(ROUNDS):
        k = LENGTHS[r % len(LENGTHS)]
        got = draft(graphed, one, k, True, n_top)
        for other in (draft(graphed, ref, k, False, n_top), draft(eager, plain, k, True, n_top)):
            assert len(got[0]) == k and got[0] == other[0], (r, k)
            if n_top:
                np.testing.assert_array_equal(got[1], other[1])
                np.testing.assert_array_equal(got[2], other[2])
        accept_part([one, ref, plain], got[0], r)
    be = graphed.model.backend
    chains = [key for key in be.graph_keys if "chain" in key]
    # (1, 1, "chain", n, input pointers...): one graph per chain length k, n = k - 1 forwards
    assert sorted(key[3] for key in chains) == sorted(k - 1 for k in LENGTHS), chains
    assert eager.model.backend.n_graphs == 0
