"""The configuration values: frozen dataclasses, their ranges and every problem at once.

`EngineConfig.problems()` lists every invalid value at once as (field, message) pairs, so the
CLI, startup and the ValidateConfig RPC report the same problems with the same words. Where the
values come from (defaults, file, env, flags) is loader.py's business.
"""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass
from pathlib import Path

from service.errors import ConfigError
from service.formats import KV_TYPES, supported_kv_pairs

# SUPPORTED_KV_PAIRS is what the backends' kernels do (service.formats.BACKEND_KV_TYPES; 'auto'
# may pick either backend, so the pairs both support).
SUPPORTED_KV_PAIRS: tuple[tuple[str, str], ...] = supported_kv_pairs("auto")
MIN_VERIFY_WIDTH = 1
MAX_VERIFY_WIDTH = 16            # one step processes 1..16 tokens (decode, verify, batching)
MAX_TREE_BUDGET = MAX_VERIFY_WIDTH   # tree verify: nodes per step (0 = chain verify)
BACKENDS = ("auto", "cpu", "cuda")
DRAFTERS = ("none", "ngram", "model", "suffix", "eagle3", "dflash")


def supported_pairs_listing() -> str:
    """A header line and one line per supported (K, V) pair, for errors and --help."""
    lines = [f"supported KV cache type pairs (K, V): {len(SUPPORTED_KV_PAIRS)}"]
    lines += [f"  {k} {v}" for k, v in SUPPORTED_KV_PAIRS]
    return "\n".join(lines)


OVERLAP_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    kv_cache_type_k: str = "f16"
    kv_cache_type_v: str = "f16"
    verify_width: int = 4            # tokens verified per speculative step (1 = no speculation)
    drafter: str = "ngram"           # "none" | "ngram" (prompt lookup) | "model" (draft GGUF)
                                     # | "suffix" (suffix index + cross-request cache)
                                     # | "eagle3" (EAGLE-3 head on the target's hidden states)
                                     # | "dflash" (DFlash block drafter, the same states)
    draft_model: str = ""            # drafter "model" / "eagle3" / "dflash": the draft GGUF
    ngram_size: int = 3              # n-gram length the lookup drafter matches
    suffix_cache_tokens: int = 65536  # drafter "suffix": tokens of other requests it keeps
    tree_budget: int = 0             # > 0: tree verify (DDTree) with this many nodes; 0: chain
    draft_p_min: float = 0.0         # drafter "dflash", a DSpark file: drafts stop at the first
                                     # whose confidence head says < this (0: off)
    backend: str = "auto"
    n_ctx: int = 4096                # context per sequence; capped at the model's trained length
    n_slots: int = 64                # sequences running at once (each holds KV blocks)
    prefill_chunk: int = 256         # prompt tokens per chunk; a wide step's padded rows
    max_step_tokens: int = 0         # tokens one engine iteration computes; 0 = chunk + 64
    kv_cache_memory: str = ""        # KV pool: bytes ("8GiB"), a fraction ("0.5"); see pool_blocks
    kv_block_size: int = 16          # positions per KV block (a power of two, 8..256)
    prefix_cache: bool = True        # reuse the KV blocks of identical prompt prefixes
    prefix_cache_exact: bool = False  # ... only those computed as the prompt's prefill would
    max_queue: int = 64              # requests waiting for a slot before RESOURCE_EXHAUSTED
    threads: int = 0                 # CPU backend threads; 0 = all cores
    cuda_graphs: bool = True         # CUDA backend: capture each step shape once and replay it
    step_profile: bool = False       # time each decode step's parts (log + Finished timings)
    overlap: str = "auto"           # auto | on | off: submit each plain decode step before the
                                     # last is read back (auto: on asynchronous backends, CUDA)
    gemv_mma: bool = False           # CUDA: quantized GEMVs on int8 tensor cores at every width

    def problems(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        pair = (self.kv_cache_type_k, self.kv_cache_type_v)
        known = all(p in KV_TYPES for p in pair)
        for side, (name, value) in enumerate(zip(("kv_cache_type_k", "kv_cache_type_v"), pair,
                                                 strict=True)):
            if value not in KV_TYPES:
                out.append((name, f"unknown KV cache type {value!r}; known types: "
                                  + ", ".join(KV_TYPES)))
            elif not known and all(p[side] != value for p in SUPPORTED_KV_PAIRS):
                # the pair cannot be judged, but this side is wrong whatever the other one is
                out.append((name, f"KV cache type {value!r} is in no supported pair as "
                                  f"{'KV'[side]}; " + supported_pairs_listing()))
        if known and pair not in SUPPORTED_KV_PAIRS:
            out.append(("kv_cache_type_k,kv_cache_type_v",
                        f"unsupported KV cache type pair (K={pair[0]}, V={pair[1]}); "
                        + supported_pairs_listing()))
        if not MIN_VERIFY_WIDTH <= self.verify_width <= MAX_VERIFY_WIDTH:
            out.append(("verify_width", f"{self.verify_width} is out of range; allowed range "
                                        f"is {MIN_VERIFY_WIDTH}..{MAX_VERIFY_WIDTH}"))
        if self.drafter not in DRAFTERS:
            out.append(("drafter", f"unknown drafter {self.drafter!r}; one of "
                                   + ", ".join(DRAFTERS)))
        if self.drafter == "model" and not self.draft_model.strip():
            out.append(("draft_model", "the model drafter needs a draft model: a .gguf path or "
                                       "a known model name sharing the target's vocabulary"))
        if self.drafter == "dflash" and not self.draft_model.strip():
            out.append(("draft_model", "the dflash drafter needs a draft model: a DFlash "
                                       ".gguf in llama.cpp's format made for the target"))
        if self.drafter == "eagle3" and not self.draft_model.strip():
            out.append(("draft_model", "the eagle3 drafter needs a draft model: an EAGLE-3 "
                                       ".gguf in llama.cpp's format made for the target"))
        if self.tree_budget != 0 and not 2 <= self.tree_budget <= MAX_TREE_BUDGET:
            out.append(("tree_budget", f"{self.tree_budget} is out of range; allowed 0 (chain "
                                       f"verify) or 2..{MAX_TREE_BUDGET}"))
        if not 0.0 <= self.draft_p_min <= 1.0:
            out.append(("draft_p_min", f"{self.draft_p_min} is out of range; allowed 0 (off) "
                                       "..1"))
        elif self.draft_p_min > 0 and self.drafter != "dflash":
            out.append(("draft_p_min", "the confidence cut is the dflash drafter's (a DSpark "
                                       f"file's confidence head); drafter {self.drafter!r} has "
                                       "none: leave it 0"))
        if not 0 <= self.suffix_cache_tokens <= 1 << 24:
            out.append(("suffix_cache_tokens", f"{self.suffix_cache_tokens} is out of range; "
                        "allowed 0..16777216"))
        if not 1 <= self.ngram_size <= 8:
            out.append(("ngram_size", f"{self.ngram_size} is out of range; allowed 1..8"))
        if self.overlap not in OVERLAP_MODES:
            out.append(("overlap", f"unknown overlap mode {self.overlap!r}; one of "
                                   + ", ".join(OVERLAP_MODES)))
        if self.backend not in BACKENDS:
            out.append(("backend", f"unknown backend {self.backend!r}; one of "
                                   + ", ".join(BACKENDS)))
        if not 16 <= self.n_ctx <= 1 << 20:
            out.append(("n_ctx", f"{self.n_ctx} is out of range; allowed 16..1048576"))
        if not 1 <= self.n_slots <= 256:
            out.append(("n_slots", f"{self.n_slots} is out of range; allowed 1..256"))
        if not 1 <= self.prefill_chunk <= 1024:
            out.append(("prefill_chunk", f"{self.prefill_chunk} is out of range; allowed 1..1024"))
        if self.max_step_tokens and not 32 <= self.max_step_tokens <= 4096:
            out.append(("max_step_tokens", f"{self.max_step_tokens} is out of range; allowed 0 "
                                           "(prefill_chunk + 64) or 32..4096"))
        try:
            parse_memory(self.kv_cache_memory)
        except ValueError as e:
            out.append(("kv_cache_memory", str(e)))
        bs = self.kv_block_size
        if not 8 <= bs <= 256 or bs & (bs - 1):
            out.append(("kv_block_size", f"{bs} is not a power of two in 8..256"))
        if not 0 <= self.max_queue <= 100_000:
            out.append(("max_queue", f"{self.max_queue} is out of range; allowed 0..100000"))
        if not 0 <= self.threads <= 1024:
            out.append(("threads", f"{self.threads} is out of range; allowed 0..1024"))
        return out


MAX_STEP_ROWS = 64               # rows of one decode step (all sequences' tokens together)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40,
          "tb": 10**12, "tib": 1 << 40}


def parse_memory(text: str) -> tuple[str, float]:
    """kv_cache_memory: ("default", 0) for "", ("bytes", n) for "8GiB" / "512MiB" / "1e9" /
    "4096", ("fraction", f) for a number in (0, 1] such as "0.5". ValueError with the rules."""
    t = text.strip().lower().replace(" ", "")
    if not t:
        return "default", 0.0
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not 0 < value * _UNITS[unit] < math.inf:    # NaN fails too
        raise ValueError(f"{text!r} is neither a size (e.g. 8GiB, 512MiB, 2000000000) nor a "
                         "fraction in (0, 1] of the memory free after loading the model")
    if not unit and value <= 1:
        return "fraction", value
    return "bytes", value * _UNITS[unit]


def step_budget(config: EngineConfig) -> tuple[int, int]:
    """(decode rows per step, prefill chunk) under config.max_step_tokens B: the decode step
    holds at most min(64, B - 16) rows and the prefill chunk is min(prefill_chunk, B - rows),
    a fixed size so a prompt's KV rows never depend on the load. B = 0: 64 rows and
    prefill_chunk."""
    b = config.max_step_tokens
    if not b:
        return MAX_STEP_ROWS, config.prefill_chunk
    rows = min(MAX_STEP_ROWS, b - 16)
    return rows, min(config.prefill_chunk, b - rows)


# ---------------------------------------------------------------- model directory
MODELS_DIR_ENV = "SPECSTREAM_MODELS_DIR"


def models_dir_from_env() -> Path:
    """Where fetched models live: $SPECSTREAM_MODELS_DIR, else `models/` at the repository root."""
    value = os.environ.get(MODELS_DIR_ENV, "").strip()
    if value:
        return Path(value).expanduser()
    return Path(__file__).resolve().parents[2] / "models"


# ---------------------------------------------------------------- server configuration
DEFAULT_MODEL = "smollm2-135m"   # the embedded default model (service.gguf.fetch.MODELS)
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "console")
MIB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    model: str = DEFAULT_MODEL       # a .gguf path or a known model name (fetched on first use)
    models_dir: str = ""             # where fetched models live; "" = repository models/
    chat_template: str = ""          # built-in template name or Jinja file; "" = the model's own
    host: str = "127.0.0.1"          # gRPC listen address; this machine only unless given
    port: int = 50051                # gRPC port; 0 picks a free one (logged)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464         # Prometheus /metrics; 0 picks a free one; -1 turns it off
    grace_period_s: float = 10.0     # SIGTERM: in-flight streams get this long to finish
    drain_delay_s: float = 0.0       # SIGTERM: report NOT_SERVING this long before closing
    max_receive_message_bytes: int = 32 * MIB  # long token-id prompts fit; not unlimited
    max_send_message_bytes: int = 32 * MIB
    keepalive_time_s: float = 60.0   # server pings a connection quiet for this long
    keepalive_timeout_s: float = 20.0  # ...and drops it if the ping is not answered in time
    min_ping_interval_s: float = 10.0  # client pings closer together than this count as abuse
    max_connection_age_s: float = 0.0  # > 0: GOAWAY after this long, so load balancers rebalance
    stream_buffer: int = 64          # events held per stream before pending deltas are merged
    vllm_engine: bool = True         # also serve vllm.grpc.engine.VllmEngine (docs/scale-out.md)
    vllm_add_bos: bool = True        # ...and prepend BOS to its prompts where the vocab adds one
    log_level: str = "info"
    log_format: str = "json"
    tls_cert_file: str = ""          # PEM certificate chain; with tls_key_file: serve TLS only
    tls_key_file: str = ""           # PEM private key of tls_cert_file
    tls_client_ca_file: str = ""     # PEM CA bundle: clients must present a cert it signed (mTLS)
    plaintext: bool = False          # serve without TLS on a host other than loopback
    auth_token_file: str = ""        # bearer tokens, one per line; every RPC but health needs one
    reflection: bool = True          # serve grpc.reflection (grpcurl without .proto files)
    config_rpcs: bool = True         # serve GetConfig and ValidateConfig
    chat_special_tokens: bool = False  # chat message content may hold control tokens

    def problems(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []

        def check(name: str, ok: bool, message: str) -> None:
            if not ok:
                out.append((name, f"{getattr(self, name)!r} is out of range; {message}"))

        if not self.model.strip():
            out.append(("model", "must name a .gguf file or a known model"))
        if self.chat_template:
            from service.chat_templates import load_template

            try:
                load_template(self.chat_template)
            except ConfigError as e:
                out += e.problems
        check("port", 0 <= self.port <= 65535, "allowed 0..65535")
        check("metrics_port", -1 <= self.metrics_port <= 65535, "allowed -1..65535 (-1: off)")
        if self.port and self.port == self.metrics_port:
            out.append(("metrics_port", f"{self.metrics_port} is also the gRPC port"))
        check("grace_period_s", 0 <= self.grace_period_s <= 3600, "allowed 0..3600 s")
        check("drain_delay_s", 0 <= self.drain_delay_s <= 3600, "allowed 0..3600 s")
        for name in ("max_receive_message_bytes", "max_send_message_bytes"):
            check(name, 1024 <= getattr(self, name) <= 2**31 - 1, "allowed 1024..2147483647")
        check("keepalive_time_s", 1 <= self.keepalive_time_s <= 86400, "allowed 1..86400 s")
        check("keepalive_timeout_s", 1 <= self.keepalive_timeout_s <= 3600, "allowed 1..3600 s")
        check("min_ping_interval_s", 0 <= self.min_ping_interval_s <= 3600, "allowed 0..3600 s")
        check("max_connection_age_s", 0 <= self.max_connection_age_s <= 10**7,
              "allowed 0 (unlimited) .. 10000000 s")
        check("stream_buffer", 1 <= self.stream_buffer <= 100_000, "allowed 1..100000")
        if self.log_level not in LOG_LEVELS:
            out.append(("log_level", f"unknown log level {self.log_level!r}; one of "
                                     + ", ".join(LOG_LEVELS)))
        if self.log_format not in LOG_FORMATS:
            out.append(("log_format", f"unknown log format {self.log_format!r}; one of "
                                      + ", ".join(LOG_FORMATS)))
        return out + self.security_problems()

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    def security_problems(self) -> list[tuple[str, str]]:
        """TLS files that do not load or pair up, plaintext on an outside address unless asked
        for, a token file without tokens."""
        from service.credentials import read_token_file, tls_file_problems

        out = tls_file_problems(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
        if self.plaintext and self.tls:
            out.append(("plaintext", "contradicts tls_cert_file: serve TLS or plaintext"))
        if not self.tls and not self.plaintext and not is_loopback(self.host):
            out.append(("host", f"{self.host!r} is reachable from other machines and no TLS "
                                "certificate is set: give --tls-cert-file and --tls-key-file, "
                                "or --plaintext to serve without TLS (e.g. behind a "
                                "service-mesh sidecar that terminates mTLS)"))
        if self.auth_token_file:
            try:
                read_token_file(self.auth_token_file)
            except ConfigError as e:
                out += e.problems
        return out

    def resolved_models_dir(self) -> Path:
        return Path(self.models_dir).expanduser() if self.models_dir else models_dir_from_env()


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    """Whether a listen address is reachable from this machine only."""
    name = host.strip().lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False
