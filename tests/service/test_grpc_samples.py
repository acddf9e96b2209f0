"""GenerateRequest.n over gRPC on the CPU backend: each sample its own index, seed (base + i),
Started and Finished; the samples are reproducible and each equals the single request with its
seed; the prompt's KV blocks are computed once (the other samples take them from the prefix
cache); n out of range is refused by name."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc

from clients import error_details
from tests.support.engines import running_engine
from tests.support.grpc_harness import TEST_ENGINE, serving

PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith "
          "in Mainz combined movable metal type, oil-based ink and a wooden press into a system "
          "that")
SAMPLED = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=8,
               ignore_eos=True)


def test_samples_have_their_own_index_seed_and_stream(client):
    responses = list(client.generate(PROMPT, n=3, seed=11, **SAMPLED))
    by_index = {i: [r for r in responses if r.index == i] for i in range(3)}
    assert {r.index for r in responses} == {0, 1, 2}
    for i, rs in by_index.items():
        kinds = [r.WhichOneof("event") for r in rs]
        assert kinds[0] == "started" and kinds[-1] == "finished"
        assert kinds.count("started") == kinds.count("finished") == 1
        assert rs[0].started.seed == 11 + i
    assert responses[-1].WhichOneof("event") == "finished"
    samples = client.complete_samples(PROMPT, n=3, seed=11, **SAMPLED)
    assert len({tuple(s.token_ids) for s in samples}) == 3          # distinct draws
    again = client.complete_samples(PROMPT, n=3, seed=11, **SAMPLED)
    assert [s.token_ids for s in again] == [s.token_ids for s in samples]
    for i, s in enumerate(samples):
        alone = client.complete(PROMPT, seed=11 + i, **SAMPLED)
        assert alone.token_ids == s.token_ids and alone.text == s.text


def test_samples_share_the_prompt_blocks(client):
    samples = client.complete_samples(PROMPT + " (n)", n=4, **SAMPLED)
    prompt = samples[0].prompt_tokens
    assert prompt >= 32
    seeds = [s.seed for s in samples]
    assert seeds == [seeds[0] + i for i in range(4)]               # the server drew the base
    for s in samples[1:]:                                           # all full blocks shared
        assert s.usage.cached_prompt_tokens == prompt - prompt % 16 - (prompt % 16 == 0) * 16


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_refused_by_name(fake_client, n):
    with pytest.raises(grpc.RpcError) as ei:
        fake_client.complete(tokens=[1], n=n)
    e = error_details(ei.value)
    assert (e.code, [f for f, _ in e.field_violations]) == ("INVALID_ARGUMENT", ["n"])


def test_prompt_logprobs_come_in_every_samples_started(client):
    ids = list(client.tokenize(PROMPT).ids)
    one = client.complete(tokens=ids, prompt_logprobs=True, prompt_top_logprobs=2, **SAMPLED)
    assert [lp.token_id for lp in one.prompt_logprobs] == ids[1:]
    assert all(len(lp.top) == 2 and lp.top[0].logprob >= lp.logprob - 1e-6
               for lp in one.prompt_logprobs)
    samples = client.complete_samples(tokens=ids, n=3, prompt_logprobs=True,
                                      prompt_top_logprobs=2, **SAMPLED)
    for s in samples:
        assert s.prompt_logprobs == one.prompt_logprobs
    assert client.complete(tokens=ids, **SAMPLED).prompt_logprobs == []


@pytest.mark.parametrize("kw, field", [
    (dict(prompt_top_logprobs=2), "output.prompt_top_logprobs"),
    (dict(prompt_logprobs=True, prompt_top_logprobs=21), "output.prompt_top_logprobs")])
def test_prompt_logprob_options_are_refused_by_name(fake_client, kw, field):
    with pytest.raises(grpc.RpcError) as ei:
        fake_client.complete(tokens=[1], **kw)
    e = error_details(ei.value)
    assert (e.code, [f for f, _ in e.field_violations]) == ("INVALID_ARGUMENT", [field])


def test_more_samples_than_the_server_runs_and_queues_are_refused_by_name(model_path):
    """n samples are n engine requests: on a server of 2 slots and a queue of 4, n = 7 got
    Started and Deltas of sample 0, then RESOURCE_EXHAUSTED with a retry delay, idle as the
    server was, so a retrying client never got an answer. Both protocols refuse it first."""
    config = replace(TEST_ENGINE, n_slots=2, max_queue=4)
    with running_engine(model_path, config=config) as engine, \
            serving(engine) as (srv, client):
        with pytest.raises(grpc.RpcError) as ei:
            list(client.generate(PROMPT, n=7, **SAMPLED))
        e = error_details(ei.value)
        assert (e.code, [f for f, _ in e.field_violations]) == ("INVALID_ARGUMENT", ["n"])
        assert len(client.complete_samples(PROMPT, n=6, **SAMPLED)) == 6
        with grpc.insecure_channel(srv.target) as channel:
            req = vpb.GenerateRequest(
                tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]),
                sampling_params=vpb.SamplingParams(n=7, max_tokens=2), stream=True)
            with pytest.raises(grpc.RpcError) as ei:
                list(vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(req, timeout=120))
        e = error_details(ei.value)
        assert (e.code, [f for f, _ in e.field_violations]) == ("INVALID_ARGUMENT",
                                                                ["sampling_params.n"])
