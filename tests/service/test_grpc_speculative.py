"""Per-request speculative options over gRPC: accepted within the server's limits with the same
output as plain decoding (greedy and seeded sampling), refused outside them with the field
named; Usage's decode steps and tokens per step; the step profile in Finished timings."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from clients import SpecstreamClient, error_details
from service.config import EngineConfig
from service.serve import BackgroundServer
from tests.conftest import TINY

from .grpc_harness import TEST_ENGINE

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n" \
         "def fib2(n):\n"
SAMPLED = {"temperature": 0.6, "top_k": 20, "seed": 5}


def refusal(client: SpecstreamClient, **kw) -> tuple[str, str, str]:
    """(status, the violated field, its description) of a refused Generate."""
    with pytest.raises(grpc.RpcError) as ei:
        list(client.generate(tokens=[1, 2, 3], max_new_tokens=2, **kw))
    e = error_details(ei.value)
    assert len(e.field_violations) == 1, e
    return e.code, *e.field_violations[0]


def test_width_within_the_server_limit_keeps_the_output(client):
    assert TEST_ENGINE.verify_width == 4 and TEST_ENGINE.tree_budget == 0
    for sampling in ({"temperature": 0.0}, SAMPLED):
        plain = client.complete(PROMPT, max_new_tokens=24, ignore_eos=True,
                                speculative_mode="off", **sampling)
        assert plain.usage.draft_tokens == 0
        assert plain.usage.decode_steps == 23 and plain.usage.mean_tokens_per_step == 1.0
        drafted = 0
        for width in (2, 3, 4):
            spec = client.complete(PROMPT, max_new_tokens=24, ignore_eos=True,
                                   speculative_mode="chain", speculative_width=width,
                                   **sampling)
            assert spec.token_ids == plain.token_ids, (sampling, width)
            u = spec.usage
            assert u.decode_steps + u.accepted_draft_tokens == 23
            assert u.mean_tokens_per_step == pytest.approx(23 / u.decode_steps)
            drafted += u.draft_tokens
        assert drafted > 0
        # enabled alone still works, and says the same
        on = client.complete(PROMPT, max_new_tokens=24, ignore_eos=True, speculative=True,
                             **sampling)
        assert on.token_ids == plain.token_ids


def test_timings_have_no_profile_when_it_is_off(client):
    t = client.complete(PROMPT, max_new_tokens=8, temperature=0.0).timings
    assert (t.draft_ms, t.heads_ms, t.verify_ms, t.other_ms) == (0, 0, 0, 0)
    assert t.decode_ms > 0


@pytest.mark.parametrize(("kw", "code", "field"), [
    ({"speculative_width": 5}, "INVALID_ARGUMENT", "speculative.width"),
    ({"speculative_width": 1}, "INVALID_ARGUMENT", "speculative.width"),
    ({"speculative_mode": "chain", "speculative_tree_budget": 3}, "INVALID_ARGUMENT",
     "speculative.tree_budget"),
    ({"speculative": True, "speculative_mode": "off"}, "INVALID_ARGUMENT", "speculative.mode"),
    ({"speculative": False, "speculative_mode": "chain"}, "INVALID_ARGUMENT",
     "speculative.mode"),
    ({"speculative_mode": "off", "speculative_width": 2}, "INVALID_ARGUMENT",
     "speculative.width"),
    ({"speculative_mode": "tree"}, "FAILED_PRECONDITION", "speculative.mode"),
    ({"speculative_tree_budget": 4}, "FAILED_PRECONDITION", "speculative.tree_budget"),
])
def test_options_outside_the_limits_are_refused(client, kw, code, field):
    got = refusal(client, **kw)
    assert got[:2] == (code, field), got


def test_an_unknown_mode_number_is_refused(client):
    from clients.client import build_generate_request

    req = build_generate_request(tokens=[1, 2], max_new_tokens=2)
    req.speculative.mode = 17          # proto3 enums are open: the number travels
    with pytest.raises(grpc.RpcError) as ei:
        list(client.generate(request=req))
    e = error_details(ei.value)
    assert e.code == "INVALID_ARGUMENT" and e.field_violations[0][0] == "speculative.mode"


# ------------------------------------------------------------ a tree server with the profiler
@pytest.fixture(scope="module")
def tree_client() -> Iterator[SpecstreamClient]:
    """A tiny model served with tree_budget 8, verify_width 6 and the step profiler on."""
    from service.engine.engine import Engine

    cfg = EngineConfig(backend="cpu", n_ctx=128, n_slots=2, verify_width=6, tree_budget=8,
                       step_profile=True)
    engine = Engine.load(TINY / "tiny-qwen3.gguf", cfg)
    engine.start()
    try:
        with BackgroundServer(engine) as srv, SpecstreamClient(srv.target, timeout=120) as c:
            yield c
    finally:
        engine.stop(10)


def test_tree_options_within_the_server_budget(tree_client):
    cfg = tree_client.get_config()
    assert cfg.tree_budget == 8 and cfg.step_profile
    ids = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = tree_client.complete(tokens=ids, max_new_tokens=12, ignore_eos=True,
                                 speculative=False, **SAMPLED)
    for kw in ({"speculative_mode": "tree"}, {"speculative_tree_budget": 2},
               {"speculative_mode": "tree", "speculative_tree_budget": 8},
               {"speculative_mode": "chain", "speculative_width": 6}):
        got = tree_client.complete(tokens=ids, max_new_tokens=12, ignore_eos=True,
                                   **SAMPLED, **kw)
        assert got.token_ids == plain.token_ids, kw
    for kw, field in (({"speculative_tree_budget": 9}, "speculative.tree_budget"),
                      ({"speculative_tree_budget": 1}, "speculative.tree_budget"),
                      ({"speculative_width": 7}, "speculative.width")):
        assert refusal(tree_client, **kw)[:2] == ("INVALID_ARGUMENT", field)


def test_step_profile_in_finished_timings(tree_client):
    done = tree_client.complete(tokens=[5, 6, 7, 5, 6, 7, 5, 6], max_new_tokens=16,
                                ignore_eos=True, temperature=0.0)
    t = done.timings
    assert t.verify_ms > 0 and t.heads_ms > 0 and t.other_ms > 0
    assert t.draft_ms + t.heads_ms + t.verify_ms + t.other_ms <= t.decode_ms + 5.0
