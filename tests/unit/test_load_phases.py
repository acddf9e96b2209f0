"""Engine.load reports each phase of a model load with its duration, in order."""

from __future__ import annotations

from structlog.testing import CapturingLogger

from service.config import EngineConfig
from service.engine import loader
from service.engine.engine import Engine
from tests.conftest import TINY

PHASES = ["header", "tokenizer", "backend", "weights", "kv_cache", "warmup"]


def test_load_logs_every_phase_with_duration(monkeypatch):
    # The engine's own logger records the calls: structlog's capture_logs() misses loggers
    # that an earlier test's configure_logging() cached on first use.
    rec = CapturingLogger()
    monkeypatch.setattr(loader, "log", rec)   # loading and warmup log through the loader
    eng = Engine.load(TINY / "tiny-qwen3.gguf",
                      EngineConfig(backend="cpu", n_ctx=64, n_slots=1, threads=1))
    eng.start()
    try:
        eng.warmup()
    finally:
        eng.stop()
    events = [{"event": c.args[0], **c.kwargs} for c in rec.calls if c.args]
    phases = [e for e in events if e["event"] == "load_phase"]
    assert [e["phase"] for e in phases] == PHASES
    for e in phases:
        assert isinstance(e["seconds"], float) and e["seconds"] >= 0, e
    by_name = {e["phase"]: e for e in phases}
    assert by_name["header"]["n_tensors"] > 0
    assert by_name["tokenizer"]["vocab_size"] == eng.tokenizer.vocab_size
    loaded = next(e for e in events if e["event"] == "model_loaded")
    total = sum(by_name[p]["seconds"] for p in PHASES[:-1])
    assert abs(loaded["seconds"] - total) < 0.05 + 0.01 * total
