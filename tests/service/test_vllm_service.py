"""vllm.grpc.engine.VllmEngine (service/vllm_service.py) on the real CPU engine (SmolLM2),
through a real gRPC client: Generate (streamed and not) gives the ids, log-probabilities and
samples of the own Generate for the same request; every field the engine cannot honour is
refused with INVALID_ARGUMENT naming it; Abort, HealthCheck while draining, GetLoads,
GetModelInfo, GetTokenizer and SubscribeKvEvents answer from the engine's real state."""

from __future__ import annotations

import hashlib
import io
import json
import re
import threading
import time
import zipfile
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from tokenizers import Tokenizer as HFTokenizer

from service.config import ServerConfig
from service.engine import constraint
from tests.support.grpc_harness import serving

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture()
def vllm(server):
    with grpc.insecure_channel(server.target) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


def gen(stub, ids, stream=False, request_id="", **sampling):
    req = pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=ids),
                             sampling_params=pb.SamplingParams(**sampling), stream=stream)
    return list(stub.Generate(req, timeout=120))


def prompt_ids(engine, text=PROMPT):
    return engine.tokenizer.encode(text, parse_special=True)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_generate_gives_the_ids_and_logprobs_of_own_generate(vllm, client, engine, stream):
    own = client.complete(PROMPT, temperature=0.0, max_new_tokens=10, top_logprobs=2,
                          ignore_eos=True)
    out = gen(vllm, prompt_ids(engine), stream, temperature=0.0, max_tokens=10, logprobs=2,
              ignore_eos=True)
    complete = out[-1].complete
    if stream:
        chunks = [r.chunk for r in out[:-1]]
        assert all(r.WhichOneof("response") == "chunk" for r in out[:-1]) and chunks
        ids = [t for c in chunks for t in c.token_ids]
        assert [c.completion_tokens for c in chunks] == \
            [sum(len(x.token_ids) for x in chunks[:i + 1]) for i in range(len(chunks))]
        lps = [v for c in chunks for v in c.output_logprobs.token_logprobs]
        tops = [list(t.token_ids) for c in chunks for t in c.output_logprobs.top_logprobs]
        assert list(complete.output_ids) == []        # the ids went out in the chunks
    else:
        ids = list(complete.output_ids)
        lps = list(complete.output_logprobs.token_logprobs)
        tops = [list(t.token_ids) for t in complete.output_logprobs.top_logprobs]
    assert ids == own.token_ids
    assert lps == pytest.approx([lp.logprob for lp in own.logprobs])
    assert tops == [[t.token_id for t in lp.top] for lp in own.logprobs]
    assert (complete.finish_reason, complete.completion_tokens, complete.prompt_tokens) == \
        ("length", 10, own.prompt_tokens)


def test_logprobs_zero_reports_the_chosen_token_only(vllm, engine):
    complete = gen(vllm, prompt_ids(engine), temperature=0.0, max_tokens=3, logprobs=0)[-1]
    lp = complete.complete.output_logprobs
    assert list(lp.token_ids) == list(complete.complete.output_ids) and len(lp.token_ids) == 3
    assert all(not t.token_ids for t in lp.top_logprobs)


def test_n_samples_are_own_samples_with_seeds_seed_plus_i(vllm, client, engine):
    out = gen(vllm, prompt_ids(engine), temperature=1.0, max_tokens=6, n=3, seed=11,
              ignore_eos=True)
    by_index = {r.complete.index: list(r.complete.output_ids) for r in out}
    assert sorted(by_index) == [0, 1, 2]
    for i, ids in by_index.items():
        own = client.complete(PROMPT, temperature=1.0, max_new_tokens=6, seed=11 + i,
                              ignore_eos=True, top_k=0, top_p=1.0, min_p=0.0)
        assert ids == own.token_ids
    assert len({tuple(v) for v in by_index.values()}) > 1


def test_text_input_truncation_and_stop_ids(vllm, client, engine):
    ids = prompt_ids(engine)
    text = pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(
        temperature=0.0, max_tokens=4))
    by_text = list(vllm.Generate(text, timeout=120))[-1].complete
    assert by_text.prompt_tokens == len(ids)
    assert list(by_text.output_ids) == list(gen(vllm, ids, temperature=0.0,
                                                max_tokens=4)[-1].complete.output_ids)
    cut = gen(vllm, ids, temperature=0.0, max_tokens=2, truncate_prompt_tokens=5)[-1].complete
    assert cut.prompt_tokens == 5
    own = client.complete(tokens=ids[-5:], temperature=0.0, max_new_tokens=2)
    assert list(cut.output_ids) == own.token_ids
    stop = list(by_text.output_ids)[1]
    stopped = gen(vllm, ids, temperature=0.0, max_tokens=4, stop_token_ids=[stop])[-1]
    assert (stopped.complete.finish_reason, stopped.complete.matched_token_id) == ("stop", stop)
    assert list(stopped.complete.output_ids) == list(by_text.output_ids)[:2]
    # the sampling controls map to ours: the same ids as the own protocol's request
    controls = dict(frequency_penalty=0.7, presence_penalty=0.4, logit_bias={stop: -100.0})
    mapped = gen(vllm, ids, temperature=0.0, max_tokens=6, min_tokens=3, ignore_eos=True,
                 **controls)[-1].complete
    own = client.complete(tokens=ids, temperature=0.0, max_new_tokens=6, min_tokens=3,
                          ignore_eos=True, **controls)
    assert list(mapped.output_ids) == own.token_ids and stop not in own.token_ids
    # prompt log-probabilities: the own API's Started.prompt_logprobs, none for the first token
    scored = client.complete(tokens=ids, temperature=0.0, max_new_tokens=2,
                             prompt_logprobs=True, prompt_top_logprobs=2)
    for stream in (False, True):
        got = gen(vllm, ids, temperature=0.0, max_tokens=2, prompt_logprobs=2, stream=stream)
        lp = next(r.chunk.input_logprobs if r.HasField("chunk") else r.complete.input_logprobs
                  for r in got if (r.chunk if r.HasField("chunk") else r.complete)
                  .HasField("input_logprobs"))
        assert list(lp.token_ids) == ids and not lp.token_logprobs[0].HasField("value")
        assert [v.value for v in lp.token_logprobs[1:]] == [
            x.logprob for x in scored.prompt_logprobs]
        assert [list(t.token_ids) for t in lp.top_logprobs[1:]] == [
            [t.token_id for t in x.top] for x in scored.prompt_logprobs]


REFUSED = [
    ("sampling_params.min_tokens", dict(min_tokens=3)),
    ("sampling_params.frequency_penalty", dict(frequency_penalty=2.5)),
    ("sampling_params.presence_penalty", dict(presence_penalty=-3.0)),
    ("sampling_params.logit_bias[5]", dict(logit_bias={5: 101.0})),
    ("sampling_params.logit_bias[-1]", dict(logit_bias={-1: 1.0})),
    ("sampling_params.logit_bias", dict(logit_bias={i: 1.0 for i in range(301)})),
    ("sampling_params.prompt_logprobs", dict(prompt_logprobs=-1)),
    ("sampling_params.prompt_logprobs", dict(prompt_logprobs=21)),
    ("sampling_params.logprobs", dict(logprobs=-1)),
    ("sampling_params.logprobs", dict(logprobs=21)),
    ("sampling_params.json_schema", dict(json_schema="{not json")),
    ("sampling_params.regex", dict(regex="a(")),
    ("sampling_params.grammar", dict(grammar="root ::= (")),
    ("sampling_params.structural_tag", dict(structural_tag="{}")),
    ("sampling_params.choice", dict(choice=pb.ChoiceConstraint(choices=[""]))),
    ("sampling_params.seed", dict(seed=-1)),
    ("sampling_params.n", dict(n=17)),
    ("sampling_params.temperature", dict(temperature=-1.0)),
    ("sampling_params.top_p", dict(top_p=1.5)),
    ("sampling_params.max_tokens", dict(max_tokens=0)),
    ("sampling_params.stop_token_ids[0]", dict(stop_token_ids=[10**6])),
    ("sampling_params.truncate_prompt_tokens", dict(truncate_prompt_tokens=0)),
]
REQUEST_REFUSED = [
    ("mm_inputs", dict(mm_inputs=pb.MultimodalInputs(mm_hashes=["x"]))),
    ("extra_mm_inputs", dict(extra_mm_inputs=[pb.MultimodalInputs()])),
    ("media_refs", dict(media_refs=pb.MediaRefs())),
    ("kv_transfer_params", dict(kv_transfer_params=pb.KvTransferParams(remote_port=1))),
    ("kv_transfer_params_json", dict(kv_transfer_params_json="{}")),
    ("data_parallel_rank", dict(data_parallel_rank=1)),
]


@pytest.mark.parametrize("field, sampling", REFUSED, ids=[f"{f}={v}" for f, v in REFUSED])
def test_a_field_the_engine_cannot_honour_is_refused_by_name(vllm, engine, field, sampling):
    with pytest.raises(grpc.RpcError) as err:
        gen(vllm, prompt_ids(engine), **{"max_tokens": 2, **sampling})
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()


@pytest.mark.parametrize("field, extra", REQUEST_REFUSED, ids=[f for f, _ in REQUEST_REFUSED])
def test_a_request_field_not_served_is_refused_by_name(vllm, engine, field, extra):
    req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=prompt_ids(engine)),
                             sampling_params=pb.SamplingParams(max_tokens=2), **extra)
    with pytest.raises(grpc.RpcError) as err:
        list(vllm.Generate(req, timeout=60))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()


@pytest.mark.parametrize("text", ["", "hello " * 600], ids=["empty", "past-the-context"])
def test_a_text_prompt_the_engine_refuses_is_refused_on_text(vllm, text):
    # the engine's "input" problems were named tokenized.input_ids, a field the client never set
    req = pb.GenerateRequest(text=text, sampling_params=pb.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as err:
        list(vllm.Generate(req, timeout=60))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("text:"), err.value.details()


def test_abort_ends_a_running_request_and_loads_see_it(vllm, engine):
    stream = vllm.Generate(pb.GenerateRequest(
        request_id="to-abort", tokenized=pb.TokenizedInput(input_ids=prompt_ids(engine)),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
        stream=True), timeout=120)
    first = next(stream)
    assert first.WhichOneof("response") == "chunk"
    load = vllm.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0]
    assert load.num_running_reqs + load.num_waiting_reqs >= 1
    assert 0 < load.num_used_tokens <= load.max_total_num_tokens
    assert load.token_usage == pytest.approx(load.num_used_tokens / load.max_total_num_tokens)
    vllm.Abort(pb.AbortRequest(request_ids=["to-abort"]), timeout=10)
    rest = list(stream)
    assert rest[-1].complete.finish_reason == "abort"
    assert rest[-1].complete.completion_tokens < 400


def test_model_info_and_the_tokenizer_archive(vllm, engine):
    info = vllm.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
    assert info.max_context_length == engine.config.n_ctx
    assert info.vocab_size == engine.spec.vocab_size
    assert sorted(info.eos_token_ids) == sorted(engine.tokenizer.eog_ids)
    assert info.served_model_name == "smollm2-135m"
    assert info.tokenizer_path.startswith("/")           # a local folder, never a hub id
    assert json.loads(info.default_sampling_params_json)["top_k"] == 40
    chunks = list(vllm.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
    data = b"".join(c.data for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        hf = HFTokenizer.from_str(zf.read("tokenizer.json").decode())
        assert zf.read("tokenizer.json") == \
            (Path(info.tokenizer_path) / "tokenizer.json").read_bytes()
    assert hf.encode(PROMPT).ids == prompt_ids(engine)


def test_kv_events_report_the_prompt_blocks_stored(vllm, engine):
    subscription = vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=120)
    first = next(subscription)
    assert first.events[0].WhichOneof("data") == "cleared"
    ids = prompt_ids(engine, "Blocks of a prompt nobody sent before: " + " ".join(
        str(i) for i in range(40)))
    batches: list = []

    def collect() -> None:
        try:
            for b in subscription:
                batches.append(b)
        except grpc.RpcError:
            pass                                        # cancelled below

    reader = threading.Thread(target=collect, daemon=True)
    reader.start()
    gen(vllm, ids, temperature=0.0, max_tokens=1)
    bs = engine.pool.block_size
    want = [tuple(ids[i * bs:(i + 1) * bs]) for i in range(len(ids) // bs)]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stored = [tuple(blk.token_ids) for b in batches for e in b.events
                  if e.WhichOneof("data") == "stored" for blk in e.stored.blocks]
        if all(w in stored for w in want):
            break
        time.sleep(0.1)
    subscription.cancel()
    assert want and all(w in stored for w in want)
    assert [b.sequence_number for b in batches] == list(range(2, 2 + len(batches)))


def test_health_says_unhealthy_while_draining(engine):
    with serving(engine) as (srv, _), grpc.insecure_channel(srv.target) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
        srv.service.state.draining = True
        health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
        assert not health.healthy and "draining" in health.message
        with pytest.raises(grpc.RpcError) as err:
            gen(stub, prompt_ids(engine), max_tokens=1)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).is_paused
        srv.service.state.draining = False


def test_the_service_can_be_turned_off(engine):
    cfg = ServerConfig(host="127.0.0.1", port=0, metrics_port=-1, vllm_engine=False)
    with serving(engine, server_cfg=cfg) as (srv, _), \
            grpc.insecure_channel(srv.target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            vllm_engine_pb2_grpc.VllmEngineStub(channel).HealthCheck(pb.HealthCheckRequest(),
                                                                     timeout=10)
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED


def test_requests_through_the_protocol_are_counted_in_the_metrics(server, vllm, engine):
    from tests.service.test_grpc_metrics_clients import scrape, value

    before = value(scrape(server), "specstream_completion_tokens_total")
    gen(vllm, prompt_ids(engine), temperature=0.0, max_tokens=5, ignore_eos=True, n=2)
    after = scrape(server)
    assert value(after, "specstream_completion_tokens_total") - before == 10
    assert value(after, "specstream_rpcs_total",
                 'code="OK",method="/vllm.grpc.engine.VllmEngine/Generate"') >= 1


def test_a_model_without_vocabulary_advertises_no_tokenizer():
    """Token ids only (the tiny fixtures): GetModelInfo names no folder, GetTokenizer is a
    failed precondition, Generate on ids still works."""
    from tests.support.engines import running_engine
    from tests.support.grpc_harness import TEST_ENGINE

    with running_engine("tiny-llama-mixq", config=TEST_ENGINE) as tiny, \
            serving(tiny) as (srv, _), grpc.insecure_channel(srv.target) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).tokenizer_path == ""
        with pytest.raises(grpc.RpcError) as err:
            list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        out = gen(stub, [1, 2, 3], temperature=0.0, max_tokens=3, ignore_eos=True)
        assert len(out[-1].complete.output_ids) == 3


def test_structured_output_fields_are_served(vllm, engine):
    out = gen(vllm, prompt_ids(engine), temperature=0.0, max_tokens=32, regex=r"[0-9]{4}")
    text = engine.tokenizer.decode(out[-1].complete.output_ids)
    assert re.fullmatch(r"[0-9]{4}", text) and out[-1].complete.finish_reason == "stop"
    out = gen(vllm, prompt_ids(engine), temperature=0.0, max_tokens=32,
              choice=pb.ChoiceConstraint(choices=["north", "south"]))
    assert engine.tokenizer.decode(out[-1].complete.output_ids) in ("north", "south")


def test_a_constraint_that_dead_ends_is_abort_with_its_tokens(vllm, engine):
    """Nothing may follow "a": each sample's "a" comes back, finish reason abort (not stop,
    which says a completed constraint), and the constraint is compiled once for the request."""
    before = constraint.compilations()
    out = gen(vllm, prompt_ids(engine), temperature=0.8, max_tokens=8, n=2,
              regex=r"a[^\x00-\U0010ffff]")
    assert constraint.compilations() - before == 1
    done = [r.complete for r in out]
    assert sorted(c.index for c in done) == [0, 1]
    for c in done:
        assert engine.tokenizer.decode(c.output_ids) == "a" and c.finish_reason == "abort"
