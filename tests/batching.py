"""Requests and runners shared by the batching tests (tests/engine, tests/gpu): N requests at
once through one engine against each of them alone."""

from __future__ import annotations

import threading

from service.engine.engine import Engine, StepStats
from service.engine.types import (
    Collected,
    Delta,
    Finished,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from tests.conftest import load_json

# greedy / seeded sampling, with speculation off or on (sampled requests never draft: "mixed"
# puts them in the same steps as greedy requests that do)
MODES = ("greedy", "greedy-spec", "sampled", "mixed-spec")


def sampled(i: int) -> SamplingParams:
    penalty = 1.1 if i % 3 == 0 else 1.0       # some rows read the token history too
    return SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=1000 + i,
                          repetition_penalty=penalty, repeat_last_n=16 if penalty != 1 else 0)


def requests(mode: str, n: int, prompts: list[list[int]], base_tokens: int = 10
             ) -> list[GenerationRequest]:
    """Request i of a mode is the same whatever n is: streams of different lengths (they join
    and leave the batch at different steps) over the given prompts."""
    out = []
    for i in range(n):
        greedy = mode.startswith("greedy") or (mode == "mixed-spec" and i % 2 == 0)
        spec = None if mode.endswith("spec") and greedy else False
        out.append(GenerationRequest(
            f"{mode}-{i}", tuple(prompts[i % len(prompts)]) + (i // len(prompts) + 5,),
            SamplingParams(temperature=0.0) if greedy else sampled(i),
            StoppingCriteria(max_new_tokens=base_tokens + 2 * (i % 4), ignore_eos=True),
            speculative=spec, top_logprobs=1 if i % 5 == 1 else 0))
    return out


class Result(Collected):
    """Collected plus the log-probability records (token id, log-probability, alternatives)."""

    def __init__(self) -> None:
        super().__init__()
        self.logprobs: list = []

    def add(self, event) -> None:
        super().add(event)
        if isinstance(event, Delta):
            self.logprobs += [(lp.token_id, lp.logprob, lp.top) for lp in event.logprobs]


def smollm2_prompts() -> list[list[int]]:
    return [c["prompt_ids"] for c in load_json("llamacpp_smollm2_greedy.json")["cases"]]


def alone(engine: Engine, req: GenerationRequest, timeout: float = 300) -> Result:
    out = Result()
    for ev in engine.generate(req, timeout=timeout):
        out.add(ev)
    return out


def together(engine: Engine, reqs: list[GenerationRequest], timeout: float = 600
             ) -> tuple[list[Result], StepStats]:
    """All requests submitted at once (under the engine's lock, so they are admitted between
    the same two steps); their results and the engine's step counts over the run."""
    results = [Result() for _ in reqs]
    done = threading.Semaphore(0)

    def sink_for(i):
        def sink(ev):      # runs on the engine thread: must not block
            results[i].add(ev)
            if isinstance(ev, Finished):
                done.release()
        return sink

    with engine._lock:
        engine.stats = StepStats()
        for i, r in enumerate(reqs):
            engine.submit(r, sink_for(i))
    for _ in reqs:
        assert done.acquire(timeout=timeout)
    return results, engine.stats


def same_output(a: Result, b: Result) -> bool:
    """Same ids, text, finish reason and (bit-identical rows) the same log-probabilities."""
    return (a.token_ids == b.token_ids and a.text == b.text and a.logprobs == b.logprobs
            and a.finished.reason is b.finished.reason and a.finished.error is None)
