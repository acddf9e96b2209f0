"""Structured output on CUDA: the sample op's token masks (cuda/sampling.cu) against the CPU
reference (backends/cpu/sampling.py) on identical logits and masks, and constrained requests
through the CUDA engine (SmolLM2) giving the CPU tests' guarantees (tests/engine/
test_structured.py): valid output, speculation on = off, batched = alone."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from service.backends.cpu import sampling as ref
from service.backends.step_format import OUT_WORDS, Param, mask_words, param_record
from tests.engine.test_structured import SCHEMAS, finished_ok, mixed, request, sampled
from tests.gpu.test_models import cuda_engine
from tests.gpu.test_sampling import ROWS, assert_same, random_logits
from tests.support.batching import alone, same_output, together

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("V", [1000, 49152, 262144])
def test_masks_match_cpu(cuda, V):
    """Rows with sparse and dense masks, rows without (MASK -1), greedy and sampled, with
    adjustments on top: the same ids and log-probabilities as the CPU op."""
    rng = np.random.default_rng(V)
    W = mask_words(V)
    bits = rng.random((ROWS, V)) < np.array([0.001, 0.3, 0.9, 1.0])[np.arange(ROWS) % 4, None]
    bits[:, 0] = True                                     # at least one allowed token per row
    masks = np.packbits(np.pad(bits, ((0, 0), (0, 32 * W - V))), axis=1,
                        bitorder="little").view(np.int32)                 # (ROWS, W) i32
    hist = np.zeros((1, 8), np.int32)
    adj = np.array([[1, np.float32(50).view(np.int32)]], np.int32)
    records = [param_record(temperature=[0.0, 0.9][i % 2], top_k=[0, 40][i % 3 == 0],
                            top_p=0.95, min_p=0.0, penalty=1.0, repeat_last_n=0,
                            seed=7 + i, token_index=i, n_top=[-1, 5][i % 2], slot=-1,
                            position=0, adj_start=0, adj_count=int(i % 5 == 0),
                            mask=-1 if i % 7 == 6 else (i + 3) % ROWS)
               for i in range(ROWS)]
    params = np.array(records, np.int32)
    for _ in range(2):
        logits = random_logits(rng, ROWS, V, False)
        want = np.zeros((ROWS, OUT_WORDS), np.int32)
        ref.sample_rows(logits, params, hist, adj, want, masks)
        cuda.prepare_sampling(ROWS, V)
        out = cuda.zeros((ROWS, OUT_WORDS), "int32")
        cuda.sample(cp.asarray(logits), cp.asarray(params), cp.asarray(hist), cp.asarray(adj),
                    out, cp.asarray(masks))
        got = cuda.to_host(out)
        assert_same(got, want, records)
        for r, rec in enumerate(records):                 # and the mask held
            m = rec[Param.MASK]
            if m >= 0:
                assert bits[m, got[r, 0]], r


@pytest.fixture(scope="module")
def smol_cuda():
    with cuda_engine("smollm2", n_ctx=512, n_slots=8, draft_in_full=True) as eng:
        yield eng


def test_constrained_requests_on_cuda(smol_cuda):
    off = [alone(smol_cuda, r) for r in mixed(smol_cuda, False)]
    on = [alone(smol_cuda, r) for r in mixed(smol_cuda, None)]
    for a, b in zip(on, off, strict=True):
        assert same_output(a, b), (a.text, b.text)
    batched, _ = together(smol_cuda, mixed(smol_cuda, None))
    for a, b in zip(batched, off, strict=True):
        assert same_output(a, b), (a.text, b.text)
    from service.engine.types import Constraint
    for i, schema in enumerate(SCHEMAS):
        r = alone(smol_cuda, request(smol_cuda, f"s{i}", "JSON:",
                                     Constraint("json_schema", json.dumps(schema)), sampled(i)))
        if finished_ok(r):
            jsonschema.validate(json.loads(r.text), schema)


def test_constrained_greedy_overlapped_equals_the_one_step_loop_on_cuda():
    """The overlapped loop with constrained greedy rows (fed rows choose unmasked, the host
    checks them against their masks) streams what the one-step loop streams, on CUDA."""
    from tests.engine.test_overlap import FedSteps, constrained_requests
    reqs = constrained_requests()
    with cuda_engine("smollm2", n_slots=8, verify_width=1, overlap="on") as on, \
            cuda_engine("smollm2", n_slots=8, verify_width=1, overlap="off") as off:
        fed = FedSteps(on)
        got, stats = together(on, reqs)
        ref, _ = together(off, reqs)
        solo = alone(on, reqs[0])
    for a, b in zip(got, ref, strict=True):
        assert same_output(a, b), (a.text, b.text)
    assert same_output(solo, ref[0])
    # the overlapped path ran, and the row biased towards a refused token ("refused") had its
    # refused rows run again inside the loop (host ids among fed ones, masks packed with the
    # step). Speculation is off, as in the CPU tests' engines: a speculating row's steps are
    # planned afresh (drafts), not fed, which is why these engines once fed only 3 steps
    # (greedy) or none (sampled) on the GPU.
    print(f"\nfed steps {fed.n}, mask refusals {stats.mask_refusals}, rows run again "
          f"{fed.redo} on CUDA")
    assert fed.n > 0 and stats.mask_refusals > 0 and fed.redo > 0, fed.__dict__


def test_constrained_rows_sampled_later_equal_the_one_step_loop_on_cuda():
    """Sampled constrained rows and greedy ones with log-probabilities overlapped on CUDA: each
    fed step runs its model graph without the sample op, the host fills the masks meanwhile,
    then the sample graph runs with them (ModelRunner.sample); the streams equal the one-step
    loop's and nothing is refused."""
    from service.engine.types import GenerationRequest
    from tests.engine.test_overlap import FedSteps, constrained_requests
    from tests.support.batching import sampled as sampled_params

    reqs = [GenerationRequest(r.request_id, r.prompt_ids,
                              sampled_params(i) if i % 2 else r.sampling, r.stopping,
                              top_logprobs=0 if i % 2 else 2, constraint=r.constraint)
            for i, r in enumerate(constrained_requests())]
    with cuda_engine("smollm2", n_slots=8, verify_width=1, overlap="on") as on, \
            cuda_engine("smollm2", n_slots=8, verify_width=1, overlap="off") as off:
        fed = FedSteps(on)
        got, stats = together(on, reqs)
        ref, _ = together(off, reqs)
    for a, b in zip(got, ref, strict=True):
        assert same_output(a, b), (a.text, b.text)
    assert fed.later > 0 and stats.mask_refusals == 0, (fed.__dict__, stats.mask_refusals)
