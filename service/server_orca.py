"""ORCA load reports: a Generate call that asks for one ends with the server's load in its
trailing metadata, so an ORCA reader (Envoy's client-side weighted round robin, a gRPC client's
weighted round robin, a gateway) balances on the real load of each replica.

A call asks with request metadata, in the format it wants:

    endpoint-load-metrics-format: BIN | TEXT | JSON      (case-insensitive; any other value: none)
    endpoint-load-metrics: BIN | TEXT | JSON              (the same)

and its trailer carries the report in that format (Envoy's ORCA header forms):

    BIN   endpoint-load-metrics-bin: xds.data.orca.v3.OrcaLoadReport, serialized (binary
          metadata: gRPC base64-encodes it on the wire)
    TEXT  endpoint-load-metrics: TEXT cpu_utilization=0.12, mem_utilization=0.31, ...,
          named_metrics.queue=0, named_metrics.running=2, named_metrics.kv_usage=0.25
    JSON  endpoint-load-metrics: JSON {"cpu_utilization": 0.12, ..., "named_metrics": {...}}

What is reported (read as the call's last message goes out; its own sequence may still count
as running):

    cpu_utilization          this process's CPU time over the last sampling interval (>= 1 s),
                             as a fraction of the CPUs it may use (affinity, cgroup quota)
    mem_utilization          resident memory / the cgroup memory limit (else the host's memory)
    rps_fractional           Generate calls admitted per second over the last RPS_WINDOW_S
    application_utilization  max(KV blocks in use / pool, (running + queued) / n_slots): the
                             engine's own saturation; above 1 when requests wait for a slot
    named_metrics            queue (requests waiting for a slot), running (requests holding a
                             slot), kv_usage (KV pool blocks held by running sequences / blocks)

grpcio's core keeps `endpoint-load-metrics-bin` for its own ORCA load balancing: a Python client
does not see that trailer (Envoy, Go and Java clients do), and a request cannot ask with that
key, which a Python server never sees. The message is built from its field numbers here
(xds/data/orca/v3/orca_load_report.proto) in a descriptor pool of its own, so no other copy of
the xds protos can clash with it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

FORMAT_KEY = "endpoint-load-metrics-format"
TEXT_KEY = "endpoint-load-metrics"           # TEXT / JSON reports (and a request's format)
BIN_KEY = "endpoint-load-metrics-bin"        # binary reports
FORMATS = ("BIN", "TEXT", "JSON")
RPS_WINDOW_S = 10.0                          # rps_fractional: admissions over this window
CPU_SAMPLE_S = 1.0                           # cpu_utilization: at most one new sample a second

# xds.data.orca.v3.OrcaLoadReport: the double fields by number, and the string -> double maps
# (rps = 3, uint64, is deprecated in favour of rps_fractional and left out).
DOUBLE_FIELDS = {"cpu_utilization": 1, "mem_utilization": 2, "rps_fractional": 6, "eps": 7,
                 "application_utilization": 9}
MAP_FIELDS = {"request_cost": 4, "utilization": 5, "named_metrics": 8}
REPORT_TYPE = "xds.data.orca.v3.OrcaLoadReport"


@lru_cache(maxsize=1)
def report_class() -> type:
    """The OrcaLoadReport message class, from a descriptor made here (its own pool)."""
    f = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(
        name="specstream/xds/data/orca/v3/orca_load_report.proto",
        package="xds.data.orca.v3", syntax="proto3")
    msg = proto.message_type.add(name="OrcaLoadReport")
    for name, number in DOUBLE_FIELDS.items():
        msg.field.add(name=name, number=number, type=f.TYPE_DOUBLE, label=f.LABEL_OPTIONAL)
    for name, number in MAP_FIELDS.items():
        entry = "".join(p.capitalize() for p in name.split("_")) + "Entry"
        nested = msg.nested_type.add(name=entry)
        nested.options.map_entry = True
        nested.field.add(name="key", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
        nested.field.add(name="value", number=2, type=f.TYPE_DOUBLE, label=f.LABEL_OPTIONAL)
        msg.field.add(name=name, number=number, type=f.TYPE_MESSAGE, label=f.LABEL_REPEATED,
                      type_name=f".{REPORT_TYPE}.{entry}")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(REPORT_TYPE))


# ------------------------------------------------------------------------- a report
@dataclass(frozen=True)
class LoadReport:
    cpu_utilization: float = 0.0
    mem_utilization: float = 0.0
    rps_fractional: float = 0.0
    application_utilization: float = 0.0
    named_metrics: dict[str, float] = field(default_factory=dict)

    def scalars(self) -> dict[str, float]:
        return {"cpu_utilization": self.cpu_utilization,
                "mem_utilization": self.mem_utilization,
                "rps_fractional": self.rps_fractional,
                "application_utilization": self.application_utilization}

    def to_bytes(self) -> bytes:
        msg = report_class()(**self.scalars())
        msg.named_metrics.update(self.named_metrics)
        return msg.SerializeToString(deterministic=True)

    def to_text(self) -> str:
        pairs = [*self.scalars().items(),
                 *((f"named_metrics.{k}", v) for k, v in self.named_metrics.items())]
        return "TEXT " + ", ".join(f"{k}={v:.6g}" for k, v in pairs)

    def to_json(self) -> str:
        return "JSON " + json.dumps({**self.scalars(), "named_metrics": self.named_metrics},
                                    separators=(",", ":"))

    def trailer(self, fmt: str) -> tuple[str, str | bytes]:
        """The (key, value) of the trailing metadata entry in format BIN, TEXT or JSON."""
        if fmt == "BIN":
            return BIN_KEY, self.to_bytes()
        return TEXT_KEY, self.to_text() if fmt == "TEXT" else self.to_json()


def requested_format(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """BIN, TEXT or JSON when the call's metadata asks for a load report, else None."""
    for key, value in metadata or ():
        if key in (FORMAT_KEY, TEXT_KEY):
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            fmt = text.strip().upper()
            if fmt in FORMATS:
                return fmt
    return None


# ------------------------------------------------------------------------- what the host says
def _cgroup_cpus() -> float | None:
    """CPUs of the cgroup (v2) quota, e.g. `cpu.max` = "200000 100000" -> 2.0; None: none."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def usable_cpus() -> float:
    cpus = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
    quota = _cgroup_cpus()
    return max(min(cpus, quota) if quota else cpus, 1e-3)


def _memory_limit() -> int:
    """Bytes this process may use: the cgroup limit (v2, else v1) when set, else the host's."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:     # v1 says "no limit" with a huge number
            return int(text)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _resident_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# ------------------------------------------------------------------------- the reporter
class LoadReporter:
    """Counts admissions and reads the engine's and the process's load into a LoadReport."""

    def __init__(self, clock=time.monotonic, cpu_clock=time.process_time) -> None:
        self._clock, self._cpu_clock = clock, cpu_clock
        self._admitted: deque[float] = deque()
        self._lock = threading.Lock()
        self._started = clock()
        self._cpu_mark = (self._started, cpu_clock())
        self._cpu_util = 0.0
        self._cpus = usable_cpus()
        self._mem_limit = _memory_limit()

    def admitted(self) -> None:
        """One Generate call admitted (counted into rps_fractional)."""
        now = self._clock()
        with self._lock:
            self._admitted.append(now)
            self._prune(now)

    def _prune(self, now: float) -> None:
        while self._admitted and self._admitted[0] <= now - RPS_WINDOW_S:
            self._admitted.popleft()

    def rps(self) -> float:
        now = self._clock()
        with self._lock:
            self._prune(now)
            n = len(self._admitted)
        return n / max(min(RPS_WINDOW_S, now - self._started), 1.0)

    def cpu_utilization(self) -> float:
        now, cpu = self._clock(), self._cpu_clock()
        with self._lock:
            t0, c0 = self._cpu_mark
            if now - t0 >= CPU_SAMPLE_S:
                self._cpu_util = (cpu - c0) / (now - t0) / self._cpus
                self._cpu_mark = (now, cpu)
            return self._cpu_util

    def mem_utilization(self) -> float:
        return _resident_bytes() / self._mem_limit if self._mem_limit else 0.0

    def report(self, engine: Any) -> LoadReport:
        named: dict[str, float] = {}
        app = 0.0
        if engine is not None:
            queue, running = float(engine.queue_depth), float(engine.active)
            pool = getattr(engine, "pool", None)
            kv = pool.used_blocks / pool.n_blocks if pool is not None and pool.n_blocks else 0.0
            named = {"queue": queue, "running": running, "kv_usage": kv}
            slots = getattr(getattr(engine, "config", None), "n_slots", 0) or 1
            app = max(kv, (running + queue) / slots)
        return LoadReport(cpu_utilization=self.cpu_utilization(),
                          mem_utilization=self.mem_utilization(),
                          rps_fractional=self.rps(), application_utilization=app,
                          named_metrics=named)

    def attach(self, context: Any, engine: Any) -> None:
        """Sets the report as the call's trailing metadata when its metadata asks for one."""
        fmt = requested_format(context.invocation_metadata())
        if fmt is not None:
            context.set_trailing_metadata((self.report(engine).trailer(fmt),))
