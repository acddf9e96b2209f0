"""ORCA load reports (service/server_orca.py): a Generate call that asks for one reads the report
from its trailer with a real gRPC client, in the format it asked for; a call that does not ask
gets none. The binary report is decoded here by a wire-format reader of its own, so the field
numbers are checked against xds/data/orca/v3/orca_load_report.proto rather than against the
message class that wrote them.

The binary trailer is read with grpcurl (Go's gRPC): grpcio's core takes
`endpoint-load-metrics-bin` out of the trailers for its own ORCA load balancing, so a Python
client never sees it; the TEXT and JSON forms are read with the Python client."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
from types import SimpleNamespace

import grpc
import pytest

from service.config import EngineConfig
from service.engine.types import Started
from service.proto_build import stubs
from service.server_orca import LoadReport, LoadReporter, report_class, requested_format
from tests.service.test_grpcurl import grpcurl_path
from tests.support.fake_engine import FakeEngine, finished
from tests.support.grpc_harness import serving

# xds.data.orca.v3.OrcaLoadReport, as the .proto numbers its fields
ORCA_FIELDS = {1: "cpu_utilization", 2: "mem_utilization", 6: "rps_fractional", 7: "eps",
               8: "named_metrics", 9: "application_utilization"}


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return value, i


def decode_orca(buf: bytes) -> dict:
    """Protobuf wire format -> {field name: double, "named_metrics": {key: double}}."""
    out: dict = {"named_metrics": {}}
    i = 0
    while i < len(buf):
        tag, i = _varint(buf, i)
        number, wire = tag >> 3, tag & 7
        name = ORCA_FIELDS[number]
        if wire == 1:                                   # fixed64: a double
            out[name] = struct.unpack_from("<d", buf, i)[0]
            i += 8
        elif wire == 2:                                 # a map entry {1: key, 2: value}
            n, i = _varint(buf, i)
            entry, i = buf[i:i + n], i + n
            key, value, j = "", 0.0, 0
            while j < len(entry):
                t, j = _varint(entry, j)
                if t >> 3 == 1:
                    ln, j = _varint(entry, j)
                    key, j = entry[j:j + ln].decode(), j + ln
                else:
                    value, j = struct.unpack_from("<d", entry, j)[0], j + 8
            out[name][key] = value
        else:
            raise AssertionError(f"unexpected wire type {wire} for field {number}")
    return out


class LoadedEngine(FakeEngine):
    """Answers at once, with a load that the test sets: queue, running rows, KV pool."""

    def __init__(self) -> None:
        def answer(request, sink, handle) -> None:
            sink(Started(prompt_tokens=len(request.prompt_ids), seed=0))
            sink(finished(n=1))
        super().__init__(answer, config=EngineConfig(backend="cpu", drafter="none",
                                                     verify_width=1, n_slots=4))
        self.queue_depth, self.active = 3, 2
        self.pool = SimpleNamespace(used_blocks=48, n_blocks=64)


@pytest.fixture(scope="module")
def loaded():
    with serving(LoadedEngine()) as (srv, client):
        yield srv, client


def _generate(client, metadata=()) -> tuple[list, dict]:
    pb = stubs().generation_pb2
    stub = stubs().generation_pb2_grpc.GenerationServiceStub(client.channel)
    call = stub.Generate(pb.GenerateRequest(tokens=pb.TokenIds(ids=[1, 2, 3]),
                                            stopping=pb.StoppingCriteria(max_new_tokens=4)),
                         metadata=metadata, timeout=60)
    responses = list(call)
    assert call.code() is grpc.StatusCode.OK
    return responses, dict(call.trailing_metadata())


def _grpcurl_trailers(server, *headers: str) -> dict[str, str]:
    """The trailers grpcurl -v prints for a Generate call with these request headers."""
    cmd = [grpcurl_path(), "-plaintext", "-v", "-d", '{"tokens": {"ids": [1, 2, 3]}}']
    for h in headers:
        cmd += ["-H", h]
    out = subprocess.run([*cmd, server.target, "specstream.v1.GenerationService/Generate"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"finished"' in out.stdout
    block = out.stdout.split("Response trailers received:\n", 1)[1].split("\nSent ", 1)[0]
    return dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)


def _check_engine_load(report: dict) -> None:
    assert report["named_metrics"] == {"queue": 3.0, "running": 2.0, "kv_usage": 0.75}
    assert report["application_utilization"] == pytest.approx((2 + 3) / 4)   # above 1: waits
    assert report["rps_fractional"] > 0                  # this call was admitted
    assert 0 < report["mem_utilization"] < 1
    assert report.get("cpu_utilization", 0.0) >= 0       # proto3 leaves a 0 out


def test_binary_report_in_the_bin_trailer(loaded):
    srv, _ = loaded
    trailer = _grpcurl_trailers(srv, "endpoint-load-metrics-format: BIN")
    assert "endpoint-load-metrics" not in trailer
    raw = base64.b64decode(trailer["endpoint-load-metrics-bin"])
    _check_engine_load(decode_orca(raw))
    parsed = report_class().FromString(raw)              # and the message class reads it back
    assert dict(parsed.named_metrics) == {"queue": 3.0, "running": 2.0, "kv_usage": 0.75}


def test_text_report(loaded):
    _, client = loaded
    _, trailer = _generate(client, [("endpoint-load-metrics-format", "text")])
    value = trailer["endpoint-load-metrics"]
    assert value.startswith("TEXT ")
    pairs = dict(p.split("=", 1) for p in value.removeprefix("TEXT ").split(", "))
    report: dict = {"named_metrics": {}}
    for k, v in pairs.items():
        if k.startswith("named_metrics."):
            report["named_metrics"][k.removeprefix("named_metrics.")] = float(v)
        else:
            assert k in ORCA_FIELDS.values(), k
            report[k] = float(v)
    _check_engine_load(report)


def test_json_report(loaded):
    _, client = loaded
    _, trailer = _generate(client, [("endpoint-load-metrics", "JSON")])
    value = trailer["endpoint-load-metrics"]
    assert value.startswith("JSON ")
    report = json.loads(value.removeprefix("JSON "))
    assert set(report) <= set(ORCA_FIELDS.values())
    _check_engine_load(report)


def test_no_report_unless_asked(loaded):
    srv, client = loaded
    for metadata in ((), [("endpoint-load-metrics-format", "yaml")]):
        _, trailer = _generate(client, metadata)
        assert not {"endpoint-load-metrics", "endpoint-load-metrics-bin"} & set(trailer)
    assert not {"endpoint-load-metrics", "endpoint-load-metrics-bin"} & set(_grpcurl_trailers(srv))


def test_real_engine_reports_its_pool(client, engine):
    """The real CPU engine: the report is read as the call's Finished event goes out, when the
    engine may not yet have retired the call's own sequence (running 0 or 1)."""
    _, trailer = _generate(client, [("endpoint-load-metrics-format", "JSON")])
    report = json.loads(trailer["endpoint-load-metrics"].removeprefix("JSON "))
    m = report["named_metrics"]
    assert m["queue"] == 0.0 and m["running"] in (0.0, 1.0)
    assert 0.0 <= m["kv_usage"] <= 1.0
    assert m["kv_usage"] * engine.pool.n_blocks == pytest.approx(round(m["kv_usage"]
                                                                       * engine.pool.n_blocks))
    assert report["application_utilization"] == pytest.approx(
        max(m["kv_usage"], (m["running"] + m["queue"]) / engine.config.n_slots))
    assert report["rps_fractional"] > 0


# ------------------------------------------------------------------------- the pieces
def test_requested_format():
    assert requested_format([("x-request-id", "a"), ("endpoint-load-metrics-format", " Json")]) \
        == "JSON"
    assert requested_format([("endpoint-load-metrics", "bin")]) == "BIN"
    assert requested_format([("endpoint-load-metrics-format", "csv")]) is None
    assert requested_format(None) is None


def test_rps_counts_a_window_of_admissions():
    now = [100.0]
    reporter = LoadReporter(clock=lambda: now[0])
    now[0] = 120.0
    for _ in range(20):
        reporter.admitted()
    assert reporter.rps() == pytest.approx(2.0)          # 20 in the 10 s window
    now[0] = 130.5                                       # the window has moved past them
    assert reporter.rps() == 0.0


def test_cpu_utilization_is_cpu_time_over_wall_time_and_cpus():
    now, cpu = [0.0], [0.0]
    reporter = LoadReporter(clock=lambda: now[0], cpu_clock=lambda: cpu[0])
    reporter._cpus = 2.0
    now[0], cpu[0] = 2.0, 1.0                            # 1 CPU second in 2 s on 2 CPUs
    assert reporter.cpu_utilization() == pytest.approx(0.25)
    now[0], cpu[0] = 2.5, 2.0                            # within the sampling interval: kept
    assert reporter.cpu_utilization() == pytest.approx(0.25)


def test_text_and_json_forms():
    r = LoadReport(0.5, 0.25, 3.0, 1.5, {"queue": 2.0})
    assert r.to_text() == ("TEXT cpu_utilization=0.5, mem_utilization=0.25, rps_fractional=3, "
                           "application_utilization=1.5, named_metrics.queue=2")
    assert json.loads(r.to_json().removeprefix("JSON ")) == {
        "cpu_utilization": 0.5, "mem_utilization": 0.25, "rps_fractional": 3.0,
        "application_utilization": 1.5, "named_metrics": {"queue": 2.0}}
    assert decode_orca(r.to_bytes()) == {
        "cpu_utilization": 0.5, "mem_utilization": 0.25, "rps_fractional": 3.0,
        "application_utilization": 1.5, "named_metrics": {"queue": 2.0}}
