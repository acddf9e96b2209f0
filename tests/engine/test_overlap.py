"""The overlapped decode loop (engine.py `_decode_overlapped`, runner `submit`/`collect`): each
plain step is submitted before the previous one is read back, its ids fed on the backend from
the previous step's choices. It must stream exactly what the one-step-at-a-time loop streams:
the same ids, text, log-probabilities and finish reasons for greedy and seeded sampling (the
penalty reading the token history), stops by token, by text and by length, alone and in a
batch whose members finish at different steps; a follow-up request reusing an ended stream's
cached blocks gives what a fresh run gives, and a cancel frees the slot within a step. Each
test also checks that fed steps really ran."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from service.engine.runner.step import GREEDY, StepInput
from service.engine.types import (
    Constraint,
    Delta,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from tests.support.batching import (
    Streams,
    alone,
    same_output,
    sampled,
    smollm2_prompts,
    together,
)
from tests.support.engines import Result, run, running_engine, wait_idle
from tests.support.models import build_model, model_path


class FedSteps:
    """Counts the runner's steps submitted with fed ids (wrapping `submit`), those of them
    whose rows sampled once their masks came (`later`: steps, `later_rows`: rows), and the rows
    of fed steps that were not fed (`redo`: a refused row run again with its mask)."""

    def __init__(self, engine) -> None:
        self.n = self.later = self.later_rows = self.redo = 0
        runner, inner = engine.runner, engine.runner.submit

        def submit(inp, feed=None, masks_later=()):
            self.n += feed is not None
            self.redo += sum(f < 0 for f in feed or ())
            self.later += bool(masks_later)
            self.later_rows += len(masks_later)
            return inner(inp, feed, masks_later)

        runner.submit = submit


@pytest.fixture(scope="module")
def engines():
    """SmolLM2 with the overlapped loop and without it, 8 slots each, speculation off."""
    with running_engine("smollm2", n_slots=8, verify_width=1, overlap="on") as on, \
            running_engine("smollm2", n_slots=8, verify_width=1, overlap="off") as off:
        yield on, off


def request(i: int, sampling: SamplingParams, **stopping) -> GenerationRequest:
    prompt = tuple(smollm2_prompts()[i % 4]) + (i + 5,)
    return GenerationRequest(f"r{i}", prompt, sampling,
                             StoppingCriteria(**{"max_new_tokens": 24, **stopping}),
                             top_logprobs=2 if i % 3 == 1 else 0)


def both(engines, reqs: list[GenerationRequest]) -> tuple[list[Result], list[Result], int]:
    on, off = engines
    fed = FedSteps(on)
    got, _ = together(on, reqs)
    ref, _ = together(off, reqs)
    return got, ref, fed.n


def mismatches(got: list[Result], ref: list[Result]) -> list:
    return [(a.token_ids, b.token_ids, a.finished.reason, b.finished.reason)
            for a, b in zip(got, ref, strict=True) if not same_output(a, b)]


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_overlapped_streams_equal_one_step_at_a_time(engines, kind):
    """Eight streams of different lengths (they leave the batch at different steps)."""
    reqs = [request(i, SamplingParams(temperature=0.0) if kind == "greedy" else sampled(i),
                    max_new_tokens=6 + 3 * i, ignore_eos=True) for i in range(8)]
    got, ref, fed = both(engines, reqs)
    assert not mismatches(got, ref)
    assert fed >= 20, f"only {fed} fed steps: the overlapped loop did not run"
    assert [len(r.token_ids) for r in got] == [6 + 3 * i for i in range(8)]


def test_stops_inside_the_overlap_stream_nothing_after_them(engines):
    """Stops the host sees one step late (a stop id, a stop text, the end token): the row in
    flight for the stopped sequence is dropped, so every stream ends exactly where the
    one-step loop ends it."""
    on, off = engines
    free = [request(i, GREEDY, max_new_tokens=40, ignore_eos=True) for i in range(4)]
    long_ref, _ = together(off, free)
    stop_ids = [r.token_ids[7] for r in long_ref]
    stop_text = long_ref[1].text[len(long_ref[1].text) // 2:][:6]
    reqs = [request(0, GREEDY, max_new_tokens=40, stop_token_ids=(stop_ids[0],)),
            request(1, GREEDY, max_new_tokens=40, stop_sequences=(stop_text,)),
            request(2, GREEDY, max_new_tokens=40, stop_token_ids=(stop_ids[2],)),
            request(3, GREEDY, max_new_tokens=200)]            # may end on the end token
    got, ref, fed = both(engines, reqs)
    assert not mismatches(got, ref)
    assert fed > 0
    assert got[0].finished.reason is FinishReason.STOP_TOKEN
    assert got[0].token_ids[-1] == stop_ids[0] and len(got[0].token_ids) <= 8
    assert got[1].finished.reason is FinishReason.STOP_SEQUENCE
    assert len(got[1].token_ids) < 40


def test_a_follow_up_on_an_ended_streams_cached_blocks_equals_a_fresh_run(engines):
    """A stream ends while its next row is in flight; its blocks go to the prefix cache. A
    second request continuing its text reuses those blocks and must give what a fresh
    computation gives."""
    on, off = engines
    first = request(0, GREEDY, max_new_tokens=37, ignore_eos=True)
    a = Streams(on)
    a.submit(first)
    r0 = a.wait()[0]
    wait_idle(on)
    follow = GenerationRequest("follow", first.prompt_ids + tuple(r0.token_ids), GREEDY,
                               StoppingCriteria(max_new_tokens=12, ignore_eos=True))
    got, ref, _ = both(engines, [follow])
    assert got[0].started is not None
    assert same_output(got[0], ref[0]), (got[0].token_ids, ref[0].token_ids)
    assert on.stats.cached_tokens > 0, "the follow-up did not reuse the cached prefix"


def test_cancel_frees_the_slot_within_a_step(engines):
    on, _ = engines
    fed = FedSteps(on)
    streams = Streams(on)
    res = streams.submit(request(0, GREEDY, max_new_tokens=100_000, ignore_eos=True))
    assert streams.wait_until(lambda: len(res.token_ids) >= 5, 120)
    n_at_cancel = len(res.token_ids)
    streams.handles[0].cancel()
    assert streams.wait_until(lambda: res.finished is not None, 30)
    assert res.finished.reason is FinishReason.CANCELLED
    assert len(res.token_ids) <= n_at_cancel + 3
    wait_idle(on, 10)
    assert len(on._free_slots) == 8 and not on.pool.owned
    assert fed.n > 0


def test_a_request_joining_ends_the_overlap_and_runs_as_it_would_alone(engines):
    """A request arriving while others decode overlapped: the loop returns to the full plan
    (admission, prefill), and every stream still equals its solo run."""
    on, off = engines
    streams = Streams(on)
    early = streams.submit(request(0, GREEDY, max_new_tokens=30, ignore_eos=True))
    assert streams.wait_until(lambda: len(early.token_ids) >= 4, 120)
    late_req = request(5, sampled(5), max_new_tokens=12, ignore_eos=True)
    late = streams.submit(late_req)
    streams.wait()
    ref_early, _ = together(off, [request(0, GREEDY, max_new_tokens=30, ignore_eos=True)])
    ref_late, _ = together(off, [late_req])
    assert same_output(early, ref_early[0]) and same_output(late, ref_late[0])


def test_runner_feeds_ids_from_the_previous_step():
    """Runner level: a step fed from the previous step's choices computes what the same step
    given those ids from the host computes, and collect returns steps in submit order."""
    from service.engine.runner.model_runner import ModelRunner

    model = build_model("tiny-qwen3", n_ctx=64, n_slots=2)
    runner = ModelRunner(model, 2, 64)

    def plain(ids, pos):
        return StepInput(ids, pos, [0, 1], range(2), [GREEDY, GREEDY])

    first = runner.submit(plain([3, 4], [0, 0]))
    fed = runner.submit(plain([0, 0], [1, 1]), [1, 0])        # swapped: row 0 reads record 1
    with pytest.raises(RuntimeError, match="order"):
        runner.collect(fed)
    a = runner.collect(first)
    b = runner.collect(fed)
    assert runner.outstanding == 0
    model2 = build_model("tiny-qwen3", n_ctx=64, n_slots=2)
    ref = ModelRunner(model2, 2, 64)
    ref.step(plain([3, 4], [0, 0]))
    want = ref.step(plain([int(a.token_ids[1]), int(a.token_ids[0])], [1, 1]))
    assert np.array_equal(b.token_ids, want.token_ids)


def test_deltas_arrive_while_the_next_step_runs(engines):
    """The host emits step k's token after submitting step k + 1: a sink sees each Delta
    with at most one step of the same stream not yet emitted."""
    on, _ = engines
    seen: list[int] = []
    done = threading.Event()

    def sink(ev):
        if isinstance(ev, Delta):
            seen.append(on.runner.outstanding)
        if getattr(ev, "reason", None) is not None:
            done.set()

    on.submit(request(2, GREEDY, max_new_tokens=20, ignore_eos=True), sink)
    assert done.wait(120)
    assert max(seen) == 1 and seen.count(1) >= 10, seen


@pytest.fixture(scope="module")
def speculating():
    """SmolLM2 with the n-gram drafter (the server's default speculation), overlapped and not;
    verification taken as free so that every row with a match drafts in full."""
    with running_engine("smollm2", n_slots=4, draft_in_full=True, overlap="on") as on, \
            running_engine("smollm2", n_slots=4, draft_in_full=True, overlap="off") as off:
        yield on, off


def test_speculating_streams_overlap_between_drafts_and_equal_the_one_step_loop(speculating):
    """Speculating requests (n-gram drafter): plain steps run overlapped while the drafter has
    nothing, drafts resume when it has (the overlap ends one step later), and every stream
    equals the one-step loop's, greedy and sampled, repetitive text and not."""
    on, off = speculating
    texts = ["one two three four five one two three four five one two three",
             "The history of the printing press begins"]
    reqs = []
    for i, text in enumerate(texts * 2):
        sampling = SamplingParams(temperature=0.0) if i < 2 else sampled(i)
        reqs.append(GenerationRequest(f"s{i}", tuple(on.text_prompt_ids(text)), sampling,
                                      StoppingCriteria(max_new_tokens=40, ignore_eos=True)))
    fed = FedSteps(on)
    got, _ = together(on, reqs)
    ref, _ = together(off, reqs)
    assert not mismatches(got, ref)
    assert fed.n >= 10, f"only {fed.n} fed steps"
    assert got[0].finished.usage.draft_tokens > 0, "the repetitive greedy stream never drafted"
    assert got[0].finished.usage.accepted_draft_tokens > 0


def constrained_requests() -> list[GenerationRequest]:
    """Greedy SmolLM2 requests under JSON schemas, regexes and a choice, one unconstrained:
    rows whose unmasked choices the masks often refuse (the schemas) and seldom (the regexes)."""
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    cs = [Constraint("json_schema", json.dumps({
              "type": "object", "properties": {"a": digit, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False})),
          Constraint("regex", r"[A-Za-z ,.]{1,200}"),
          Constraint("json_schema", json.dumps({"type": "array", "items": digit,
                                                "minItems": 2, "maxItems": 4})),
          None,
          Constraint("choice", options=("the sea", "the wind", "a boat")),
          Constraint("regex", r"[a-z ]{1,200}")]
    reqs = [GenerationRequest(f"c{i}", tuple(smollm2_prompts()[i % 4]) + (i + 5,), GREEDY,
                              StoppingCriteria(max_new_tokens=20), constraint=c)
            for i, c in enumerate(cs)]
    # the ends a skipped fill leaves to the next token's check (overlap._check_unmasked): a
    # dead end after "a", and a choice that ends where the end token does not end the stream
    dead = Constraint("regex", r"a[^\x00-\U0010ffff]")
    return [*reqs,
            GenerationRequest("dead", tuple(smollm2_prompts()[1]), GREEDY,
                              StoppingCriteria(max_new_tokens=20), constraint=dead),
            GenerationRequest("eos", tuple(smollm2_prompts()[2]), GREEDY,
                              StoppingCriteria(max_new_tokens=20, ignore_eos=True),
                              constraint=Constraint("choice", options=("yes", "no"))),
            # "7" (SmolLM2's id 39) biased far above the rest where only letters may come:
            # every unmasked choice of this row is refused, whatever the backend's logits
            GenerationRequest("refused", tuple(smollm2_prompts()[3]),
                              SamplingParams(temperature=0.0, logit_bias=((39, 40.0),)),
                              StoppingCriteria(max_new_tokens=24),
                              constraint=Constraint("regex", r"[a-z ]{1,60}"))]


def test_constrained_greedy_streams_overlap_and_equal_the_one_step_loop(engines):
    """Constrained greedy rows run overlapped: a fed row chooses without its mask (the mask
    needs the token still in flight) and the host checks the choice against the mask once it
    has it; a refused choice is dropped with the row fed from it and runs again masked, in the
    loop's next step (its committed token from the host, not fed). The
    streams equal the one-step loop's, batched and alone, and refusals really happened."""
    on, off = engines
    reqs = constrained_requests()
    fed = FedSteps(on)
    got, stats = together(on, reqs)
    ref, _ = together(off, reqs)
    assert not mismatches(got, ref)
    reasons = {r.finished.reason for r in got}
    assert {FinishReason.CONSTRAINT, FinishReason.CONSTRAINT_DEAD_END} <= reasons, reasons
    assert fed.n >= 5, f"only {fed.n} fed steps"      # refusals send rows to masked steps
    assert stats.mask_refusals > 0, "no unmasked choice was refused: recovery did not run"
    assert fed.redo > 0, "no refused row ran again inside the overlapped loop"
    solo = [alone(on, r) for r in (*reqs[:3], *reqs[-2:])]
    assert all(same_output(a, b) for a, b in zip(solo, (*ref[:3], *ref[-2:]), strict=True))


def test_which_constrained_rows_overlap_and_the_refusal_backoff():
    """Constrained rows overlap unless they speculate: greedy ones without log-probabilities
    choose without their masks, sampled ones and ones with log-probabilities sample once their
    masks are filled (masks_later); a refusal sends a greedy row to masked sampling for 8
    tokens, the next for 32 (4 times as long, up to 1024), and kept unmasked choices ease the
    wait back to 8."""
    from service.engine.overlap import masks_later
    from service.engine.scheduler.sequence import Sequence
    from service.engine.spec.decode import Speculator

    class Matcher:              # allows everything, never ends
        ahead, terminated = None, False

        def mask(self):
            return np.full(2, -1, np.int32)

        first_mask = mask

        def accept(self, t):
            return True

        def done(self, mask):
            return False

    def seq(sampling=GREEDY, top_logprobs=0):
        req = GenerationRequest("r", (1, 2), sampling, StoppingCriteria(max_new_tokens=99),
                                top_logprobs=top_logprobs)
        return Sequence(request=req, sink=lambda ev: None, seed_value=0, text=None,
                        eog_ids=frozenset(), n_ctx=512, speculative=False, matcher=Matcher())

    sp = Speculator(None)
    s, other, scored = seq(), seq(sampled(1)), seq(top_logprobs=2)
    assert sp.overlaps([s, other, scored])
    assert not masks_later(s) and masks_later(other) and masks_later(scored)
    speculating = seq()
    speculating.speculative = True
    assert not sp.overlaps([s, speculating])
    s.refused_unmasked()
    assert s.mask_wait == 8 and sp.overlaps([s])
    for _ in range(8):
        assert masks_later(s)
        s._advance(7)
    assert not masks_later(s)
    s.refused_unmasked()
    assert s.mask_wait == 32 and s.mask_backoff == 128
    for _ in range(5):
        s.refused_unmasked()
    assert s.mask_backoff == 1024
    for _ in range(2000):
        s.kept_unmasked()
    assert s.mask_backoff == 8


def test_sampled_constrained_streams_overlap_masked_and_equal_the_one_step_loop(engines):
    """Sampled constrained rows, and greedy ones asking for log-probabilities, run overlapped:
    each fed row's step runs the model, the host commits the token before it and fills its
    mask meanwhile, then the step samples with that mask (runner.sample). Nothing is refused,
    and the streams equal the one-step loop's (which samples every row with its mask), among
    greedy rows that choose unmasked."""
    on, off = engines
    reqs = constrained_requests()
    reqs = [r if i % 3 == 2 else GenerationRequest(
                r.request_id, r.prompt_ids, sampled(i) if i % 3 == 0 else GREEDY, r.stopping,
                top_logprobs=0 if i % 3 == 0 else 2, constraint=r.constraint)
            for i, r in enumerate(reqs)]
    fed = FedSteps(on)
    got, stats = together(on, reqs)
    ref, _ = together(off, reqs)
    assert not mismatches(got, ref)
    assert fed.n >= 5 and fed.later >= 5 and fed.later_rows >= 10, fed.__dict__
    assert any(r.logprobs for r in got)
    solo = [alone(on, r) for r in reqs[:4]]
    assert all(same_output(a, b) for a, b in zip(solo, ref[:4], strict=True))


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_a_draft_model_overlaps_its_plain_steps_and_catches_up_at_probes(overlap):
    """A draft model (not pure, no hidden states read) whose drafts do not pay (verify rows
    priced at 5 plain steps each): its sequence's plain steps run overlapped, and every probe
    (one draft each probe_every() steps) first catches the draft model up on the tokens of the
    overlapped steps, in KV blocks the loop took for them: the same model drafting for itself
    then proposes exactly the target's next token (every probe accepted), and the stream is
    plain decoding's."""
    target = model_path("tiny-qwen3")
    ids, n_new = list(range(5, 21)), 64
    with running_engine(target) as eng:
        want = run(eng, ids, max_new_tokens=n_new, ignore_eos=True, speculative=False).token_ids
    with running_engine(target, drafter="model", draft_model=str(target), verify_width=4,
                        overlap=overlap) as eng:
        eng.verify_alpha = 5.0                    # after it: drafts never pay, probes only
        fed = FedSteps(eng)
        out = run(eng, ids, max_new_tokens=n_new, ignore_eos=True)
        assert out.token_ids == want
        u = out.finished.usage
        assert 2 <= u.draft_tokens <= n_new // eng.scheduler.probe_every() + 1, u
        assert u.accepted_draft_tokens == u.draft_tokens, u
        assert (fed.n >= n_new // 2) if overlap == "on" else fed.n == 0, fed.n


def test_a_step_sampled_later_on_the_fake_device(compiled):
    """On the CUDA backend (fake device): a fed step submitted with masks_later runs the model
    without the sample op (its own graph, keyed "sample later"), `sample` uploads the mask and
    runs the sample op as a graph of its own per logits count; three rounds capture and replay
    both, and the step's readback is queued only after the sample op."""
    from service.backends import create_backend
    from service.backends.step_format import mask_words
    from tests.support.fake_cupy import install

    with install(compiled) as dev:
        tr = build_model("tiny-qwen3", create_backend("cuda"), n_ctx=64, n_slots=2,
                         max_tokens=16, max_logits=8)
        from service.engine.runner import ModelRunner

        runner = ModelRunner(tr, 2, 64)
        mask = np.zeros(mask_words(tr.spec.vocab_size), np.int32)
        mask[0] = 0b110                                  # tokens 1 and 2
        pending = runner.submit(StepInput([5, 6], [0, 0], [0, 1], [0, 1], [GREEDY] * 2))
        for k in range(3):
            ahead = runner.submit(StepInput([0, 0], [k + 1] * 2, [0, 1], [0, 1], [GREEDY] * 2),
                                  feed=[0, 1], masks_later=[1])
            runner.collect(pending)
            with pytest.raises(RuntimeError, match="after `sample`"):
                runner.collect(ahead)
            runner.sample(ahead, [mask])
            pending = ahead
        runner.collect(pending)
        keys = tr.backend.graph_keys
        assert (2, 2, "sample later") in {k[:3] for k in keys}
        assert (2, "sample") in {k[:2] for k in keys}

        def kernels(g) -> list[str]:
            return [getattr(n, "kernel", "") for n in g.nodes]

        later = [g for g in dev.graphs if "sample_rows" not in kernels(g)
                 and any(k.startswith("gemv") for k in kernels(g))]
        alone = [g for g in dev.graphs if "sample_rows" in kernels(g)
                 and not any(k.startswith("gemv") for k in kernels(g))]
        assert later and alone and all(g.replays for g in later + alone)


def test_an_end_token_under_ignore_eos_ends_constrained_rows_as_the_one_step_loop_does(engines):
    """Constrained rows whose end token (made likely by logit_bias, ignore_eos on) is taken
    where the constraint allows more text: the matcher takes it as its stop token and the
    stream ends with CONSTRAINT after it, overlapped (greedy unmasked, sampled masked later)
    as in the one-step loop; a fill past the stop token failed the whole step before."""
    on, off = engines
    eos = on.tokenizer.eos_id
    bias = ((eos, 30.0),)
    kinds = [SamplingParams(temperature=0.0, logit_bias=bias),
             SamplingParams(temperature=0.8, seed=3, logit_bias=bias), GREEDY]
    reqs = [GenerationRequest(f"x{i}", tuple(smollm2_prompts()[i % 4]) + (i + 5,), p,
                              StoppingCriteria(max_new_tokens=20, ignore_eos=True),
                              constraint=Constraint("regex", r"[0-9a-z ]{1,40}"))
            for i, p in enumerate(kinds)]
    fed = FedSteps(on)
    got, _ = together(on, reqs)
    ref, _ = together(off, reqs)
    assert not mismatches(got, ref)
    assert all(r.finished.error is None for r in got)
    for r in got[:2]:
        assert r.finished.reason is FinishReason.CONSTRAINT and r.token_ids[-1] == eos, r.finished
    assert fed.n >= 1, fed.__dict__


def test_a_constraint_complete_before_min_tokens_ends_sampled_rows_as_the_one_step_loop(engines):
    """A sampled JSON row whose object closes before its min_tokens: the constraint allows
    nothing but the end token, which min_tokens bans, so the row in flight had an empty draw
    (the CPU sample op raised and failed the whole step; every stream of the batch ended with
    an error). That row is dropped anyway (the constraint ends the stream, CONSTRAINT): it now
    samples over every token. Streams equal the one-step loop's, greedy and unconstrained
    rows beside them."""
    on, off = engines
    digit = json.dumps({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                        "maximum": 9}}, "required": ["a"], "additionalProperties": False})
    reqs = [GenerationRequest(f"m{i}", tuple(smollm2_prompts()[i % 4]) + (i + 5,), p,
                              StoppingCriteria(max_new_tokens=24, min_tokens=24),
                              constraint=c)
            for i, (p, c) in enumerate([(sampled(1), Constraint("json_schema", digit)),
                                        (sampled(2), Constraint("json_schema", digit)),
                                        (GREEDY, Constraint("json_schema", digit)),
                                        (sampled(3), None)])]
    fed = FedSteps(on)
    got, _ = together(on, reqs)
    ref, _ = together(off, reqs)
    assert all(r.finished.error is None for r in got), [r.finished for r in got]
    assert not mismatches(got, ref)
    assert [r.finished.reason for r in got[:3]] == [FinishReason.CONSTRAINT] * 3, got
    assert fed.later > 0, fed.__dict__


@pytest.mark.parametrize("side,where", [(0, "batch"), (1, "batch"), (0, "accept")])
def test_a_constraint_that_fails_ends_its_own_request_not_its_batch(engines, monkeypatch, side,
                                                                    where):
    """A matcher whose accept or fill raises (xgrammar failing; injected here for one request's
    constraint from its third call on: in the step's batch advance, or in the overlapped
    loop's check of an unmasked choice) ends that request with ERROR after the tokens it had
    streamed; the step's other requests, constrained or not, stream what they stream without
    it, overlapped (side 0) and in the one-step loop (side 1). It used to fail the whole step:
    every request in it ended with ERROR."""
    from service.engine import constraint as C
    from service.engine.scheduler import sequence as SQ
    eng = engines[side]
    poison = r"[a-z ]{1,199}"
    init, batch, accept = C.Matcher.__init__, SQ.advance_rows, C.Matcher.accept
    calls = {"n": 0}

    def mark(self, compiled, vocab_size):
        init(self, compiled, vocab_size)
        self.poisoned = compiled.constraint.text == poison

    def hit(matchers) -> None:
        if any(getattr(m, "poisoned", False) for m in matchers):
            calls["n"] += 1
            if calls["n"] >= 3:
                raise RuntimeError("injected matcher failure")

    def failing(matchers, tokens, fill=None):
        hit(matchers)
        return batch(matchers, tokens, fill)

    def failing_accept(self, token):
        hit([self])
        return accept(self, token)
    monkeypatch.setattr(C.Matcher, "__init__", mark)
    if where == "batch":
        monkeypatch.setattr(SQ, "advance_rows", failing)
    else:
        monkeypatch.setattr(C.Matcher, "accept", failing_accept)
    others = constrained_requests()[:4]              # two JSON schemas, a regex, a plain one
    bad = GenerationRequest("bad", tuple(smollm2_prompts()[1]), GREEDY,
                            StoppingCriteria(max_new_tokens=20),
                            constraint=Constraint("regex", poison))
    got, _ = together(eng, [*others[:2], bad, *others[2:]])
    ref = [alone(eng, r) for r in others]
    assert got[2].finished.reason is FinishReason.ERROR, got[2].finished
    assert "injected matcher failure" in got[2].finished.error
    assert len(got[2].token_ids) >= 2, got[2].token_ids
    rest = got[:2] + got[3:]
    assert all(r.finished.error is None for r in rest), [r.finished for r in rest]
    assert all(same_output(a, b) for a, b in zip(rest, ref, strict=True))
    wait_idle(eng)
    assert eng.pool.used_blocks == 0
