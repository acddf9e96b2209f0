"""The model runner on the CUDA backend: captured steps (model, token history and sample op in
one graph) replay to the same ids and log-probabilities as eager steps, seeded draws replay,
and every sampled id is the CPU reference's choice on the GPU's own logits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from service.backends.cpu import sampling as ref
from service.backends.step_format import OUT_WORDS, param_record
from service.engine.runner import GREEDY, ModelRunner, RowSampling, StepInput
from service.model.transformer import Transformer
from tests.support.engines import running_engine
from tests.support.models import build_model

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu
N_SLOTS, N_CTX = 2, 64


def build(graphs: bool) -> tuple[Transformer, ModelRunner]:
    from service.backends.cuda.backend import CudaBackend

    tr = build_model("tiny-qwen3", CudaBackend(graphs=graphs), n_ctx=N_CTX, n_slots=N_SLOTS,
                     max_tokens=32, max_logits=16)
    return tr, ModelRunner(tr, N_SLOTS, N_CTX)


def session(tr: Transformer, runner: ModelRunner) -> list:
    """Prefill 10 tokens, 6 sampled decode steps (penalty on), a greedy verify step of 4 rows
    with log-probabilities; each sampled id is checked against the CPU op on the GPU logits."""
    V = tr.spec.vocab_size
    hist = [(13 * i + 2) % V for i in range(10)]
    seen = []

    def step(ids, start, rows):
        n, L = len(ids), len(rows)
        out = runner.step(StepInput(ids, range(start, start + n), [1] * n, range(n - L, n),
                                    rows))
        logits = tr.backend.to_host(tr.ws_logits[:L])                   # (L, V) f32
        for r, s in enumerate(rows):
            if s.temperature:
                got = np.zeros(OUT_WORDS, np.int32)
                h = np.zeros((1, N_CTX), np.int32)
                h[0, :start + n] = hist[:start + n]
                rec = np.array(param_record(
                    temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                    penalty=s.repetition_penalty, repeat_last_n=s.repeat_last_n, seed=s.seed,
                    token_index=s.token_index, n_top=-1, slot=0,
                    position=start + n - L + r), np.int32)
                ref.sample_row(logits[r], rec, h, np.zeros((1, 2), np.int32), got)
                assert got[0] == out.token_ids[r]
        seen.append((out.token_ids.tolist(), out.logprobs))
        return out

    sampled = RowSampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                          repetition_penalty=1.2, repeat_last_n=8, seed=77, n_top=2)
    out = step(hist, 0, [sampled])
    hist.append(int(out.token_ids[0]))
    for i in range(1, 7):
        out = step(hist[-1:], len(hist) - 1, [replace(sampled, token_index=i)])
        hist.append(int(out.token_ids[0]))
    verify = replace(GREEDY, n_top=5)
    step(hist[-1:] + [1, 2, 3], len(hist) - 1, [verify] * 4)
    return seen


def test_graphs_equal_eager_and_seeded_sampling_replays():
    eager = session(*build(graphs=False))
    tr, runner = build(graphs=True)
    graphed = session(tr, runner)
    assert graphed == eager
    assert tr.backend.n_graphs >= 1                # the decode steps were captured and replayed
    assert session(tr, runner) == eager            # a second run replays the same draws


def test_engine_on_cuda_replays_seeded_requests():
    """Through the whole engine (scheduler, runner, graphs): a seeded sampled request with a
    repetition penalty and log-probabilities gives the same tokens and log-probabilities twice."""
    from service.engine.types import Delta, GenerationRequest, SamplingParams, StoppingCriteria

    with running_engine("tiny-qwen3", backend="cuda", n_ctx=64, n_slots=2, threads=1) as eng:
        def run(seed: int) -> tuple[list, list]:
            req = GenerationRequest(
                "s", (1, 2, 3, 4, 5), SamplingParams(temperature=0.9, repetition_penalty=1.3,
                                                     seed=seed),
                StoppingCriteria(max_new_tokens=24, ignore_eos=True), top_logprobs=3)
            deltas = [e for e in eng.generate(req, timeout=120) if isinstance(e, Delta)]
            return ([t for d in deltas for t in d.token_ids],
                    [lp for d in deltas for lp in d.logprobs])

        (ids_a, lp_a), (ids_b, lp_b) = run(5), run(5)
        assert ids_a == ids_b and len(ids_a) == 24
        assert lp_a == lp_b and len(lp_a) == 24 and all(len(lp.top) == 3 for lp in lp_a)
        assert [lp.token_id for lp in lp_a] == ids_a
