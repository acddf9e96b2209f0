"""The host's work per step done once per step, not once per row: the runner packs a step's
sampling records as arrays from each request's static record (equal, word for word, to each
row's own RowSampling.record), rows copied from a request's template (RowSampling.at) carry
nothing of the template's draw, and the server's streams share one event-loop wake-up per
batch of events (LoopMailbox), each stream's events in order."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from service.backends.step_format import N_PARAMS, mask_words
from service.engine.runner import GREEDY, ModelRunner, RowSampling, StepInput
from service.engine.runner.model_runner import DRAFT, TARGET
from service.engine.runner.step import Adjustment
from service.engine.types import Delta, SamplingParams
from service.server_generate import EventBuffer, mailbox
from tests.support.models import build_model

N_SLOTS, N_CTX, MAX_TOKENS = 4, 64, 24


def model():
    return build_model("tiny-qwen3", CpuBackend(threads=1), n_ctx=N_CTX, n_slots=N_SLOTS,
                       max_tokens=MAX_TOKENS, max_logits=16)


def varied_rows(vocab: int) -> list[RowSampling]:
    """Rows that differ in every record word: greedy, sampled with penalties and a 64-bit seed,
    log-probabilities, logit adjustments (two rows sharing one), a token mask, a scored id."""
    sampled = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                             repetition_penalty=1.1, repeat_last_n=16, frequency_penalty=0.3,
                             presence_penalty=0.2, seed=(1 << 40) + 12345)
    bias = Adjustment.of([(3, 1.5), (9, -2.0)], banned=[2])
    other = Adjustment.of([(5, 0.25)])
    mask = np.zeros(mask_words(vocab), np.int32)                        # (W,) i32
    mask[0] = 0b1011
    base = RowSampling.of(sampled, (1 << 40) + 12345, 0, 5, gen_start=7)
    base.static_record()            # cached before the copies: they must not take its draw
    return [GREEDY,
            RowSampling.of(sampled, 99, 3, -1, gen_start=2),
            base.at(4, bias),
            base.at(5, bias),
            base.at(6, other, mask),
            replace(GREEDY, n_top=3, score_id=11),
            base.at(7, None)]


def expected_records(inp: StepInput, history: bool) -> np.ndarray:
    """Each row's own RowSampling.record (the reference), its adjustment pairs placed in order
    of first use, one range per Adjustment."""
    placed: dict[int, int] = {}
    n = 0
    out = []
    for r, (row, s) in enumerate(zip(inp.logit_rows, inp.sampling, strict=True)):
        start = 0
        if s.adjust is not None:
            if id(s.adjust) not in placed:
                placed[id(s.adjust)], n = n, n + len(s.adjust.pairs)
            start = placed[id(s.adjust)]
        where = (inp.slots[row], inp.positions[row]) if history else (0, 0)
        fresh = replace(s)          # built by __init__: nothing cached
        out.append(fresh.record(*where, start, r))
    return np.array(out, np.int32)                                       # (L, N_PARAMS) i32


@pytest.mark.parametrize("kind", [TARGET, DRAFT], ids=["target", "draft"])
def test_packed_records_equal_each_rows_record(kind):
    tr = model()
    runner = ModelRunner(tr, N_SLOTS, N_CTX, kind)
    rows = varied_rows(tr.spec.vocab_size)
    L, T = len(rows), len(rows) + 3
    inp = StepInput(list(range(1, T + 1)), [10 + 2 * i for i in range(T)],
                    [i % N_SLOTS for i in range(T)], range(T - L, T), rows)
    h = runner._hosts[0]
    T_pad, where, _ = runner._layout(inp)
    runner._pack(inp, T_pad, where, h, None)
    got = h[runner._o_par:runner._o_par + L * N_PARAMS].reshape(L, N_PARAMS)
    want = expected_records(inp, kind.history)
    assert (got == want).all(), np.argwhere(got != want)
    assert len({tuple(r) for r in want}) == L        # the rows differ: the test can tell


def test_row_copies_keep_the_request_and_take_the_draw():
    p = SamplingParams(temperature=0.5, top_k=3, seed=4)
    base = RowSampling.of(p, 4, 0, 2, gen_start=9)
    static = base.static_record().copy()
    adj = Adjustment.of([(1, 1.0)])
    row = base.at(17, adj)
    assert row == RowSampling.of(p, 4, 17, 2, gen_start=9, adjust=adj)
    assert row.token_index == 17 and base.token_index == 0 and base.adjust is None
    assert (row.static_record() == static).all()
    with pytest.raises(ValueError):
        row.static_record()[0] = 1              # shared by the copies: read-only
    fresh = RowSampling.of(p, 5, 0, -1)         # copies made before anyone asked for it
    a, b = fresh.at(1, None), fresh.at(2, adj)
    assert a.static_record() is b.static_record() is fresh.static_record()
    assert RowSampling(**vars(a)) == a          # a copy holds its fields and nothing else


# ------------------------------------------------------------------ the streams' mailbox
def test_one_loop_wakeup_per_batch_and_each_stream_in_order():
    async def run() -> tuple[list[list[int]], int, int]:
        loop = asyncio.get_running_loop()
        bufs = [EventBuffer(loop, maxsize=1000) for _ in range(3)]
        box = mailbox(loop)
        assert all(b._mailbox is box for b in bufs)
        hops0 = box.hops
        for i in range(60):                     # the loop cannot drain meanwhile: one batch
            bufs[i % 3].sink(Delta((i,), str(i)))
        one = box.hops - hops0
        got = [[(await b.get()).token_ids[0] for _ in range(20)] for b in bufs]
        bufs[0].sink(Delta((60,), "60"))        # drained: the next event wakes the loop again
        got[0].append((await bufs[0].get()).token_ids[0])
        return got, one, box.hops - hops0

    got, first, total = asyncio.run(run())
    assert first == 1 and total == 2
    assert got == [list(range(0, 60, 3)) + [60], list(range(1, 60, 3)), list(range(2, 60, 3))]


# ------------------------------------------------------------------ plain decode rows
class Chain(list):
    """A draft list verify_input does not take for plain (its general, per-segment path)."""


def test_plain_rows_equal_the_general_segment_path():
    from service.engine.mixed import mixed_input
    from service.engine.spec.decode import verify_input
    from tests.engine.test_mixed_steps import decoded, seq

    seqs = [seq(i, 4 + i, greedy=i % 2 == 0) for i in range(5)]
    for i, s in enumerate(seqs):
        s.slot = 4 - i
        decoded(s, 20 + i)
    fast = verify_input([(s, [s.seed]) for s in seqs])
    general = verify_input([(s, Chain([s.seed])) for s in seqs])
    mixed = mixed_input([(s, [s.seed]) for s in seqs], [])
    for inp in (fast, mixed):
        assert (list(inp.token_ids), list(inp.positions), list(inp.slots),
                list(inp.logit_rows), list(inp.sampling), inp.kv_positions) == (
            list(general.token_ids), list(general.positions), list(general.slots),
            list(general.logit_rows), list(general.sampling), general.kv_positions)
    assert list(fast.token_ids) == [20, 21, 22, 23, 24] and list(fast.slots) == [4, 3, 2, 1, 0]
