"""The SMG gateway (PyPI `smg`) in front of `specstream serve` workers, for the scale-out tests:
workers and gateway run as subprocesses on 127.0.0.1, each logging to a file the test reads
(a worker's JSON access log tells which RPCs reached it)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.grpc_harness import ROOT, specstream_bin, specstream_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smg_bin() -> str:
    return str(Path(sys.executable).parent / "smg")


def smg_unusable() -> str | None:
    """Why the smg gateway cannot run here, or None when it can."""
    exe = smg_bin()
    if not Path(exe).exists():
        return f"the smg gateway is not installed ({exe}); `pip install -e .[dev]` installs it"
    try:
        out = subprocess.run([exe, "launch", "--help"], capture_output=True, text=True,
                             timeout=60)
    except OSError as exc:
        return f"the smg binary cannot run on this machine: {exc}"
    if out.returncode != 0:
        return f"the smg binary cannot run on this machine: {out.stderr.strip()[-300:]}"
    return None


KERNELS = ROOT / "service" / "backends" / "cpu"      # the numba-cached kernels' package


def private_numba_cache(directory: Path) -> Path:
    """A numba cache of one worker's own: `directory`, seeded with a copy of this checkout's
    cached CPU kernels where there are some. Workers compiling at once into one cache corrupt
    it (a corrupted cache computes wrong numbers in every later run of the checkout); with a
    cache each, no file has two writers and the checkout's own cache is only read."""
    # numba's layout for NUMBA_CACHE_DIR: <dir>/<parent dir name>_<sha1 of the source dir>/
    sub = directory / f"{KERNELS.name}_{hashlib.sha1(str(KERNELS).encode()).hexdigest()}"
    sub.mkdir(parents=True, exist_ok=True)
    for f in (KERNELS / "__pycache__").glob("*.nb[ic]"):
        shutil.copy2(f, sub / f.name)
    return directory


class Worker:
    """`specstream serve MODEL ARGS` on 127.0.0.1 and a free port, with a numba cache of its
    own (private_numba_cache); JSON log in `log`."""

    def __init__(self, model: str, log: Path, args: list[str]) -> None:
        self.log = log
        self._out = log.open("w")
        cache = private_numba_cache(log.with_suffix(".numba"))
        self.proc = subprocess.Popen(
            [specstream_bin(), "serve", model, "--host", "127.0.0.1", "--port", "0",
             "--metrics-port", "-1", *args],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self._out, text=True,
            env=specstream_env({"NUMBA_CACHE_DIR": str(cache)}))
        self.port = 0

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def wait_serving(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("worker exited early:\n" + self.log.read_text())
            events = self.events()
            for e in events:
                if e.get("event") == "listening":
                    self.port = int(e["port"])
            if any(e.get("event") == "serving" for e in events):
                return
            time.sleep(0.2)
        raise AssertionError("worker not serving in time:\n" + self.log.read_text())

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def rpcs(self, method: str, after: str | None = None) -> int:
        """Calls of `method` (e.g. 'Generate' of the VllmEngine) in the access log, counted
        after the first event named `after` when given."""
        events = self.events()
        if after is not None:
            first = next((i for i, e in enumerate(events) if e.get("event") == after),
                         len(events))
            events = events[first:]
        return sum(1 for e in events if e.get("event") == "rpc"
                   and e.get("method") == f"/vllm.grpc.engine.VllmEngine/{method}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._out.close()


class Gateway:
    """`smg launch` routing to `urls` with `args`; HTTP on 127.0.0.1:port."""

    def __init__(self, urls: list[str], log: Path, args: list[str]) -> None:
        self.port = free_port()
        self.log = log
        self._out = log.open("w")
        env = {**os.environ, "NO_COLOR": "1"}
        self.proc = subprocess.Popen(
            [smg_bin(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
             "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1",
             "--worker-urls", *urls, *args],
            stdout=self._out, stderr=subprocess.STDOUT, env=env)

    def get(self, path: str, timeout: float = 10) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                    timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict, timeout: float = 120) -> Any:
        """JSON response of a POST (a stream: the list of its data events, [DONE] left out)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
        if not body.get("stream"):
            return json.loads(raw)
        return [json.loads(line[6:]) for line in raw.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]

    def healthy_workers(self) -> int:
        """Workers the gateway counts healthy (its /readiness answers 503 with none)."""
        try:
            body = self.get("/readiness")
        except urllib.error.HTTPError as exc:
            try:
                body = json.loads(exc.read())
            except ValueError:
                return 0
        except (urllib.error.URLError, OSError, ValueError):
            return 0
        return int(body.get("healthy_workers", 0))

    def wait_healthy(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("gateway exited:\n" + self.log.read_text()[-3000:])
            if self.healthy_workers() == n:
                return
            time.sleep(0.2)
        raise AssertionError(f"gateway never saw {n} healthy workers:\n"
                             + self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self._out.close()
