"""Requests and runners shared by the batching tests (tests/engine, tests/gpu): N requests at
once through one engine against each of them alone."""

from __future__ import annotations

import threading
from collections.abc import Callable

from service.engine.types import GenerationRequest, SamplingParams, StoppingCriteria
from tests.support.engines import Engine, Result, StepStats
from tests.support.models import load_json

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


SYSTEM = [(11 * j) % 900 + 20 for j in range(40)]     # a 40-token shared "system prompt"


def shared_prompts(n: int) -> list[list[int]]:
    """n prompts that begin with SYSTEM and differ after it."""
    return [SYSTEM + [(7 * i + j) % 500 + 5 for j in range(3 + i % 5)] for i in range(n)]


def smollm2_prompts() -> list[list[int]]:
    return [c["prompt_ids"] for c in load_json("llamacpp_smollm2_greedy.json")["cases"]]


def alone(engine: Engine, req: GenerationRequest, timeout: float = 300) -> Result:
    out = Result()
    for ev in engine.generate(req, timeout=timeout):
        out.add(ev)
    return out


class Streams:
    """Requests submitted to one engine, each collected into a Result by a sink that runs on
    the engine thread (it only records the event and wakes waiters: it never blocks)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.results: list[Result] = []
        self.handles: list = []
        self._changed = threading.Condition()

    def submit(self, req: GenerationRequest) -> Result:
        """Submits req; its Result (results[-1]; its handle is handles[-1])."""
        result = Result()
        self.results.append(result)

        def sink(ev) -> None:
            with self._changed:
                try:
                    result.add(ev)
                finally:        # a failed check must not leave the waiters asleep
                    self._changed.notify_all()

        self.handles.append(self.engine.submit(req, sink))
        return result

    def wait_until(self, condition: Callable[[], object], timeout: float = 120) -> bool:
        """True once condition() holds (checked after each event); False after `timeout`
        seconds."""
        with self._changed:
            return self._changed.wait_for(condition, timeout)

    def wait(self, timeout: float = 600) -> list[Result]:
        """Every submitted request's result, once each has finished."""
        assert self.wait_until(lambda: all(r.finished for r in self.results), timeout)
        return self.results


def together(engine: Engine, reqs: list[GenerationRequest], timeout: float = 600
             ) -> tuple[list[Result], StepStats]:
    """All requests submitted at once (under the engine's lock, so they are admitted between
    the same two steps); their results and the engine's step counts over the run."""
    streams = Streams(engine)
    with engine._lock:
        engine.stats = StepStats()
        for r in reqs:
            streams.submit(r)
    return streams.wait(timeout), engine.stats


def same_output(a: Result, b: Result) -> bool:
    """Same ids, text, finish reason and (bit-identical rows) the same log-probabilities."""
    return (a.token_ids == b.token_ids and a.text == b.text and a.logprobs == b.logprobs
            and a.finished.reason is b.finished.reason and a.finished.error is None)
