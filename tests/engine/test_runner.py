"""The model runner on the CPU backend: capture sizes, padding rows that change nothing, one
upload and one readback per step, token choice through the sample op (the same function as
the host Sampler), and the step-input checks."""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.base import capture_sizes
from service.backends.cpu.backend import CpuBackend
from service.engine.runner import GREEDY, ModelRunner, RowSampling, StepInput
from service.engine.sampling import Sampler
from service.engine.types import SamplingParams
from service.model.transformer import Transformer, positions_for
from tests.support.models import build_model

N_SLOTS, N_CTX, MAX_TOKENS = 3, 64, 24


@pytest.fixture()
def tiny():
    tr = build_model("tiny-qwen3", CpuBackend(threads=1), n_ctx=N_CTX, n_slots=N_SLOTS,
                     max_tokens=MAX_TOKENS, max_logits=16)
    return tr, ModelRunner(tr, N_SLOTS, N_CTX)


def direct_logits(tr: Transformer, ids, start: int, slot: int, n_logits: int) -> np.ndarray:
    n = len(ids)
    return np.array(tr.forward(np.asarray(ids, np.int32), positions_for(start, n),
                               np.full(n, slot, np.int32), start + n, n_logits))


def greedy_step(ids, start: int, slot: int, n_logits: int) -> StepInput:
    n = len(ids)
    return StepInput(ids, range(start, start + n), [slot] * n, range(n - n_logits, n),
                     [GREEDY] * n_logits)


def test_step_sizes():
    assert capture_sizes(256) == (1, 2, 4, 8, 16, 256)
    assert capture_sizes(16) == (1, 2, 4, 8, 16)
    assert capture_sizes(5) == (1, 2, 4, 5)
    assert CpuBackend(threads=1).step_sizes(80) == (1, 2, 4, 8, 16, 32, 48, 64, 80)


@pytest.mark.parametrize("n", [3, 5, 19])     # padded to 4, 8 and 24 (the largest step)
def test_padding_rows_change_nothing(tiny, n):
    tr, runner = tiny
    ids = [(7 * i + 3) % tr.spec.vocab_size for i in range(n)]
    L = min(n, 4)
    out = runner.step(greedy_step(ids, 0, 0, L))
    assert runner.padded(n) > n
    got = np.array(tr.ws_logits[:L])
    # padding rows (slot -1) wrote no KV row: every other slot's pool rows are still empty
    c = tr.cache
    others = np.ones(len(c.k[0]), bool)                                 # (pool rows,)
    others[c.rows(0, np.arange(c.max_blocks * c.block_size))] = False
    for layer in range(tr.spec.n_layer):
        assert not c.k[layer][others].any() and not c.v[layer][others].any()
    # the same tokens unpadded, in another slot
    want = direct_logits(tr, ids, 0, 2, L)
    if n <= tr.backend.invariant_tokens:
        assert np.array_equal(got, want)
    else:     # prefill-sized steps go through sgemm, whose sums depend on the row count
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert out.token_ids.tolist() == np.argmax(got, axis=1).tolist()
    assert out.logprobs == (None,) * L


def test_one_upload_and_one_readback_per_step(tiny, monkeypatch):
    tr, runner = tiny
    be = tr.backend
    calls = {"upload_step": 0, "download_step": 0, "upload_ints": 0, "to_host": 0}
    for name in calls:
        real = getattr(be, name)

        def counted(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)

        monkeypatch.setattr(be, name, counted)
    runner.step(greedy_step([1, 2, 3, 4, 5], 0, 0, 0))      # a prefill chunk without logits
    runner.step(greedy_step([6], 5, 0, 1))
    runner.step(greedy_step([7, 8, 9], 6, 0, 3))           # a verify step
    assert calls == {"upload_step": 3, "download_step": 3, "upload_ints": 0, "to_host": 0}


def test_sampled_rows_equal_the_host_sampler(tiny):
    """The runner's sample op and the engine's Sampler are one function: same seed, same token
    index, same history -> same token, with log-probabilities of the raw logits."""
    tr, runner = tiny
    V = tr.spec.vocab_size
    prompt = [(11 * i + 5) % V for i in range(9)]
    params = SamplingParams(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02,
                            repetition_penalty=1.4, repeat_last_n=6, seed=99)
    for index in range(6):
        row = RowSampling.of(params, 99, index, 3)
        n = len(prompt)
        out = runner.step(StepInput(prompt, range(n), [1] * n, [n - 1], [row]))
        logits = np.array(tr.ws_logits[0])
        host = Sampler(params, V, 99).sample(logits, prompt, index=index)
        assert int(out.token_ids[0]) == host
        lp = out.logprobs[0]
        x = logits.astype(np.float64)
        lse = x.max() + np.log(np.exp(x - x.max()).sum())
        assert lp.token_id == host and lp.logprob == pytest.approx(x[host] - lse, abs=1e-5)
        assert [i for i, _ in lp.top] == np.argsort(-x, kind="stable")[:3].tolist()
        prompt = [*prompt, host]


def test_seeded_draws_replay(tiny):
    tr, runner = tiny
    prompt = [3, 1, 4, 1, 5, 9]
    n = len(prompt)
    rows = [RowSampling(temperature=1.3, seed=1234, token_index=i) for i in range(40)]
    first = [int(runner.step(StepInput(prompt, range(n), [0] * n, [n - 1], [r])).token_ids[0])
             for r in rows]
    again = [int(runner.step(StepInput(prompt, range(n), [2] * n, [n - 1], [r])).token_ids[0])
             for r in rows]
    assert first == again
    assert len(set(first)) > 1          # the index moves the draw


def test_step_input_checks(tiny):
    tr, runner = tiny
    with pytest.raises(ValueError, match="last rows"):
        runner.step(StepInput([1, 2, 3], [0, 1, 2], [0] * 3, [0], [GREEDY]))
    with pytest.raises(ValueError, match="sampling records"):
        runner.step(StepInput([1, 2], [0, 1], [0, 0], [1], []))
    with pytest.raises(ValueError):
        runner.step(StepInput(list(range(MAX_TOKENS + 1)), range(MAX_TOKENS + 1),
                              [0] * (MAX_TOKENS + 1)))
