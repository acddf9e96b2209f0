"""Scale-out behind the real SMG gateway (PyPI `smg`): three CPU workers (SmolLM2) behind
`smg launch` on 127.0.0.1, spoken to through its OpenAI-compatible HTTP front.

The gateway registers each worker over the vLLM engine protocol (service/vllm_service.py),
loads the tokenizer folder the workers advertise (from disk, nothing from the hub), renders
chat and tokenizes itself, and routes round robin. Checked: completions and chat, streamed and
not, give the text and token counts of specstream's own Generate for the same input; a worker
killed between requests is failed over; a draining worker gets no new requests.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import time
import urllib.error

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from clients import SpecstreamClient
from tests.support.models import model_path
from tests.support.smg_gateway import Gateway, Worker, smg_unusable

pytestmark = pytest.mark.slow

WORKER_FLAGS = ["--backend", "cpu", "--n-ctx", "512", "--n-slots", "4", "--threads", "1",
                "--drain-delay", "120", "--log-level", "info"]
GATEWAY_FLAGS = ["--policy", "round_robin", "--health-check-interval-secs", "1",
                 "--health-failure-threshold", "1", "--health-success-threshold", "1",
                 "--log-level", "info"]
MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a primary color."}]
N_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = smg_unusable()
    if why is not None:
        pytest.skip(why)
    path = str(model_path("smollm2"))
    logs = tmp_path_factory.mktemp("smg")
    workers: list[Worker] = []
    gateway = None
    try:
        # each worker compiles (if it must) into a numba cache of its own
        workers = [Worker(path, logs / f"worker-{n}.log", WORKER_FLAGS) for n in "abc"]
        for w in workers:
            w.wait_serving()
        gateway = Gateway([w.url for w in workers], logs / "gateway.log", GATEWAY_FLAGS)
        gateway.wait_healthy(len(workers))
        yield gateway, workers
    finally:
        if gateway is not None:
            gateway.stop()
        for w in workers:
            w.stop()


def own_generate(worker: Worker, **kw):
    """specstream's own Generate (greedy, N_TOKENS) on `worker`."""
    with SpecstreamClient(worker.target, timeout=120) as client:
        return client.complete(temperature=0.0, max_new_tokens=N_TOKENS, **kw)


def completion(gateway: Gateway, stream: bool, **extra) -> tuple[str, str, dict]:
    """(text, finish_reason, usage) of one greedy OpenAI completion through the gateway."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0,
            "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
        events = gateway.post("/v1/completions", body)
        text = "".join(c["text"] for e in events for c in e.get("choices", ()))
        reason = [c["finish_reason"] for e in events for c in e.get("choices", ())
                  if c.get("finish_reason")]
        usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
        return text, reason[-1], usage
    out = gateway.post("/v1/completions", body)
    return out["choices"][0]["text"], out["choices"][0]["finish_reason"], out["usage"]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_completions_give_the_tokens_of_own_generate(cluster, stream):
    gateway, workers = cluster
    own = own_generate(workers[0], prompt=PROMPT)
    assert own.finish_reason == "LENGTH" and len(own.token_ids) == N_TOKENS
    for _ in range(len(workers)):            # round robin: every worker answers once
        text, reason, usage = completion(gateway, stream)
        assert text == own.text
        assert reason == "length"
        assert usage["prompt_tokens"] == own.prompt_tokens
        assert usage["completion_tokens"] == len(own.token_ids)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_chat_gives_the_tokens_of_own_generate(cluster, stream):
    gateway, workers = cluster
    own = own_generate(workers[1], chat=CHAT)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": N_TOKENS, "temperature": 0,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
        events = gateway.post("/v1/chat/completions", body)
        text = "".join(c["delta"].get("content") or "" for e in events
                       for c in e.get("choices", ()))
        usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
    else:
        out = gateway.post("/v1/chat/completions", body)
        text, usage = out["choices"][0]["message"]["content"], out["usage"]
    # the gateway rendered the template and tokenized: same prompt ids, same output
    assert usage["prompt_tokens"] == own.prompt_tokens
    assert usage["completion_tokens"] == len(own.token_ids)
    assert text == own.text


def test_unset_sampling_fields_get_the_worker_defaults(cluster):
    """A seeded request that sets no sampling field samples as specstream's own Generate does
    with its defaults: the gateway filled them from GetModelInfo.default_sampling_params_json,
    not from its own (top_p 1, top_k off, min_p 0)."""
    gateway, workers = cluster
    with SpecstreamClient(workers[0].target, timeout=120) as client:
        own = client.complete(PROMPT, seed=7, max_new_tokens=N_TOKENS, ignore_eos=True)
        plain = client.complete(PROMPT, seed=7, max_new_tokens=N_TOKENS, ignore_eos=True,
                                top_k=0, top_p=1.0, min_p=0.0)
    assert plain.text != own.text                  # the defaults matter for this seed
    out = gateway.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "seed": 7,
                                           "max_tokens": N_TOKENS, "ignore_eos": True})
    assert out["choices"][0]["text"] == own.text


def test_cache_aware_routing_follows_the_kv_events(cluster, tmp_path):
    """A second gateway over the same workers, routing cache-aware: it subscribes to each
    worker's KV events and routes requests sharing a prefix by the blocks a worker reported."""
    _, workers = cluster
    gateway = Gateway([w.url for w in workers], tmp_path / "cache-aware.log",
                      ["--policy", "cache_aware", "--log-level", "debug"])
    try:
        gateway.wait_healthy(len(workers))
        prefix = "Shared context, long enough to fill several KV blocks of sixteen tokens: " + \
            " ".join(str(i) for i in range(60))
        before = [w.rpcs("Generate") for w in workers]
        for q in range(4):
            gateway.post("/v1/completions", {"model": MODEL, "prompt": f"{prefix} Q{q}:",
                                             "max_tokens": 2, "temperature": 0})
        served = [w.rpcs("Generate") - b for w, b in zip(workers, before, strict=True)]
        log = re.sub(r"\x1b\[[0-9;]*m", "", gateway.log.read_text())   # colour codes
    finally:
        gateway.stop()
    assert sorted(served) == [0, 0, 4]                  # all on the worker holding the prefix
    hits = re.findall(r'branch="event_hit" overlap_blocks=(\d+)', log)
    assert hits and all(int(n) >= 4 for n in hits), "no routing decision from KV events"


def test_a_refused_field_reaches_the_client_by_name(cluster):
    gateway, _ = cluster
    with pytest.raises(urllib.error.HTTPError) as err:
        completion(gateway, False, seed=-5)     # forwarded by the gateway, refused by the worker
    assert err.value.code == 400
    assert "sampling_params.seed: must be >= 0" in err.value.read().decode()


def test_a_client_that_leaves_aborts_its_request_on_the_worker(cluster):
    gateway, workers = cluster
    aborts = sum(w.rpcs("Abort") for w in workers)
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True,
         "temperature": 0, "stream": True}), {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.fp.readline()     # the stream has begun
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 30
    while sum(w.rpcs("Abort") for w in workers) == aborts:
        assert time.monotonic() < deadline, "no Abort reached a worker"
        time.sleep(0.1)


def test_a_worker_killed_between_requests_is_failed_over(cluster):
    gateway, workers = cluster
    expected, _, _ = completion(gateway, False)
    victim = workers[2]
    victim.signal(signal.SIGKILL)
    victim.proc.wait(30)
    # at once, before a health check can notice: round robin sends some of these to the dead
    # worker, and the gateway retries them elsewhere
    for _ in range(4):
        text, reason, _ = completion(gateway, False)
        assert (text, reason) == (expected, "length")
    # and it did: an attempt met the dead worker's closed port
    assert any(f"127.0.0.1:{victim.port}" in line and "connect error" in line
               for line in gateway.log.read_text().splitlines())


def test_a_draining_worker_gets_no_new_requests(cluster):
    gateway, workers = cluster
    live, draining = workers[0], workers[1]
    if workers[2].proc.poll() is None:       # run alone: take the third worker out first
        workers[2].signal(signal.SIGKILL)
    before = live.rpcs("Generate")
    draining.signal(signal.SIGTERM)          # --drain-delay 120: unhealthy, still answering
    deadline = time.monotonic() + 30
    while not any(e.get("event") == "draining" for e in draining.events()):
        assert time.monotonic() < deadline, "the worker never started draining"
        time.sleep(0.1)
    with grpc.insecure_channel(draining.target) as channel:
        health = vllm_engine_pb2_grpc.VllmEngineStub(channel).HealthCheck(
            vllm_engine_pb2.HealthCheckRequest(), timeout=10)
    assert not health.healthy and "draining" in health.message
    gateway.wait_healthy(1, timeout=30)
    for _ in range(4):
        text, reason, _ = completion(gateway, False)
        assert reason == "length" and text
    assert draining.rpcs("Generate", after="draining") == 0
    assert live.rpcs("Generate") == before + 4


# ------------------------------------------------------------------------- a SentencePiece model
@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Gemma-3-270M (SentencePiece vocabulary, BOS added; no template of its own, the built-in
    gemma one) behind its own gateway: the gateway tokenizes completion prompts without special
    tokens and chat renders with the exported template's BOS."""
    why = smg_unusable()
    if why is not None:
        pytest.skip(why)
    path = str(model_path("gemma3"))
    logs = tmp_path_factory.mktemp("smg-gemma")
    worker = Worker(path, logs / "worker.log", [*WORKER_FLAGS, "--chat-template", "gemma"])
    gateway = None
    try:
        worker.wait_serving()
        gateway = Gateway([worker.url], logs / "gateway.log", GATEWAY_FLAGS)
        gateway.wait_healthy(1)
        yield gateway, worker
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_sentencepiece_model_gives_the_tokens_of_own_generate(gemma, kind):
    gateway, worker = gemma
    if kind == "completion":
        own = own_generate(worker, prompt=PROMPT)
        out = gateway.post("/v1/completions", {"model": "gemma3-270m", "prompt": PROMPT,
                                               "max_tokens": N_TOKENS, "temperature": 0})
        text = out["choices"][0]["text"]
    else:
        own = own_generate(worker, chat=CHAT)
        out = gateway.post("/v1/chat/completions", {"model": "gemma3-270m", "messages": CHAT,
                                                    "max_tokens": N_TOKENS, "temperature": 0})
        text = out["choices"][0]["message"]["content"]
    # one BOS either way: the worker adds it to the completion's ids, the template writes it
    assert out["usage"]["prompt_tokens"] == own.prompt_tokens
    assert out["usage"]["completion_tokens"] == len(own.token_ids)
    assert text == own.text
