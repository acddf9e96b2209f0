"""Credentials as files name them: bearer tokens (one per line) and TLS certificate files.

A leaf (it imports nothing of the service but errors), so `service.config` checks them with the
other settings at startup, all problems at once, and the server reads them again, with the
same rules, when SIGHUP asks it to reload (service/server_auth.py, service/server_tls.py).

Token file: one token per line, then optionally the RPCs it may call; `#` starts a comment.

    9f2c...e1 (the gateway's token: every RPC)
    41aa...07 specstream.v1.GenerationService/Tokenize specstream.v1.ConfigService/GetModelInfo
    c3d0...5b specstream.v1.ConfigService

A grant is a full service name (every method of it), a full method name `Service/Method`, or
`*` (every RPC, the default when none is listed).
"""

from __future__ import annotations

import hashlib
import ssl
from dataclasses import dataclass
from pathlib import Path

from service.errors import ConfigError

MIN_TOKEN_CHARS = 16             # shorter secrets are guessable; refused at startup
SETTING = "auth_token_file"


@dataclass(frozen=True)
class TokenGrant:
    """One token of the file: its SHA-256 (the token itself is not kept) and what it may call."""

    digest: bytes
    grants: tuple[str, ...]      # ("*",) or service / "service/method" names
    line: int                    # where it is written, for the log

    def allows(self, method: str) -> bool:
        """`method` as gRPC names it: "/specstream.v1.GenerationService/Generate"."""
        full = method.lstrip("/")
        service = full.partition("/")[0]
        return any(g in ("*", service, full) for g in self.grants)


def token_digest(token: str | bytes) -> bytes:
    """What tokens are compared by: equal-length digests, compared in constant time."""
    raw = token.encode("utf-8", "surrogatepass") if isinstance(token, str) else token
    return hashlib.sha256(raw).digest()


def read_token_file(path: str) -> tuple[TokenGrant, ...]:
    """Every token of the file; ConfigError naming each bad line (or the unreadable file)."""
    try:
        text = Path(path).expanduser().read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([(SETTING, f"cannot read token file {path!r}: {exc}")]) from exc
    tokens: list[TokenGrant] = []
    problems: list[tuple[str, str]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        token, grants = words[0], tuple(words[1:]) or ("*",)
        if len(token) < MIN_TOKEN_CHARS:
            problems.append((SETTING, f"{path}:{n}: a token needs at least {MIN_TOKEN_CHARS} "
                                      "characters"))
            continue
        bad = [g for g in grants if g != "*" and ("." not in g or g.count("/") > 1)]
        if bad:
            problems.append((SETTING, f"{path}:{n}: {bad[0]!r} is neither '*', a full service "
                                      "name (specstream.v1.GenerationService) nor a method "
                                      "(specstream.v1.GenerationService/Generate)"))
            continue
        tokens.append(TokenGrant(token_digest(token), grants, n))
    if not tokens and not problems:
        problems.append((SETTING, f"token file {path!r} holds no token"))
    if problems:
        raise ConfigError(problems)
    return tuple(tokens)


@dataclass(frozen=True)
class TlsFiles:
    """The PEM bytes of a TLS configuration, read together."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None      # set: clients must present a certificate this CA signed


def read_tls_files(cert: str, key: str, client_ca: str = "") -> TlsFiles:
    """The files, checked as a TLS stack will use them: the key matches the certificate and
    the CA bundle loads. ConfigError listing every problem."""
    problems = tls_file_problems(cert, key, client_ca)
    if problems:
        raise ConfigError(problems)
    return TlsFiles(Path(cert).expanduser().read_bytes(), Path(key).expanduser().read_bytes(),
                    Path(client_ca).expanduser().read_bytes() if client_ca else None)


def tls_file_problems(cert: str, key: str, client_ca: str) -> list[tuple[str, str]]:
    """Problems of a (certificate, key, client CA) choice; none when TLS is off."""
    if not (cert or key or client_ca):
        return []
    if not cert or not key:
        missing = "tls_key_file" if cert else "tls_cert_file"
        given = "tls_cert_file" if cert else ("tls_key_file" if key else "tls_client_ca_file")
        return [(missing, f"TLS needs both a certificate and its key; only {given} is set")]
    out = [(name, f"cannot read {path!r}") for name, path in
           (("tls_cert_file", cert), ("tls_key_file", key), ("tls_client_ca_file", client_ca))
           if path and not Path(path).expanduser().is_file()]
    if out:
        return out
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(Path(cert).expanduser(), Path(key).expanduser())
    except (ssl.SSLError, OSError) as exc:
        out.append(("tls_cert_file,tls_key_file", f"{cert!r} and {key!r} do not load as a "
                                                  f"PEM certificate chain and its key: {exc}"))
    if client_ca:
        try:
            ctx.load_verify_locations(cafile=str(Path(client_ca).expanduser()))
        except (ssl.SSLError, OSError) as exc:
            out.append(("tls_client_ca_file", f"{client_ca!r} is not a PEM CA bundle: {exc}"))
    return out
