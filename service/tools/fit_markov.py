"""`specstream fit-markov`: fit a DSpark Markov head (service/engine/spec/markov_head.py) to a
drafter.

Over a corpus of N token ids x_0..x_{N-1}, the target and the drafter both run (chunked prefill
with logits for every position, CPU backend); at position t the residual is

    r_t = target_logits_t - draft_logits_t - mean   (V,)     prev_t = x_t (the row's input id)

(centered: a constant added to a row changes neither its argmax nor its softmax, and a truncated
drafter's logits sit at another level than the target's; uncentered, that offset is most of the
squared residual and the fit spends its rank on it)
and the head's correction c_t = W2 @ W1[prev_t] is fitted by least squares,
min sum_t ||r_t - W2 W1[prev_t]||^2. With W1 free per token the sum splits per prev token p
(count n_p, mean residual m_p): sum_t ||r_t - m_{p_t}||^2 + sum_p n_p ||m_p - W2 W1[p]||^2, so
the best rank-R head is the count-weighted truncated SVD of the mean residuals:

    A = diag(sqrt(n)) M   (P, V)  over the P tokens seen as prev
    W2 = the top-R right singular vectors of A   (V, R), orthonormal columns
    W1[p] = W2^T m_p   (tokens never seen as prev: a zero row)

computed through the (P, P) Gram matrix A A^T (P << V). The fitted head is written into a copy
of the draft GGUF (every tensor and key kept as it is) as F16 or F32 tensors with the metadata
the loader reads. The fit's loss (mean squared residual per logit over the corpus, before and
after the correction with the written, rounded tensors) is computed exactly from the per-token
sums: sum_t ||r_t - c_t||^2 = sum_t ||r_t||^2 - 2 sum_p n_p m_p.c_p + sum_p n_p ||c_p||^2.

`--corpus -generate` samples the corpus from the target (temperature 1, seeded) instead.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

from service.backends import create_backend
from service.engine.loader import check_draft_vocabulary
from service.engine.spec.markov_head import W1_NAME, W2_NAME, meta_key
from service.errors import ConfigError
from service.gguf.quants import QuantType
from service.gguf.reader import GGUFFile
from service.model.spec import ModelSpec
from service.model.tokenizer import Tokenizer
from service.model.transformer import Transformer

log = structlog.get_logger("specstream.fit_markov")

GENERATE = "-generate"
DTYPES = {"f16": (np.float16, QuantType.F16), "f32": (np.float32, QuantType.F32)}
CHUNK = 64                   # prefill chunk: rows of logits per forward
MAX_WINDOW = 2048            # positions per window (each window restarts at position 0)


@dataclass
class FitResult:
    path: Path
    rank: int
    n_tokens: int            # corpus positions fitted
    n_prev: int              # distinct tokens seen as prev
    loss_before: float       # mean squared residual per logit, no head
    loss_after: float        # the same with the written head
    seconds: float


# ---------------------------------------------------------------- running the two models
def load_cpu_model(path: Path, threads: int) -> tuple[GGUFFile, ModelSpec, Tokenizer, Transformer]:
    """A model on its own CPU backend, one slot of min(MAX_WINDOW, trained context) positions."""
    f = GGUFFile(path)
    spec = ModelSpec.from_gguf(f)
    n_ctx = min(MAX_WINDOW, spec.n_ctx_train)
    tok = Tokenizer.from_metadata(f.metadata) if f.get("tokenizer.ggml.tokens") else \
        Tokenizer.ids_only(spec.vocab_size)
    be = create_backend("cpu", threads=threads)
    model = Transformer(spec, f, be, n_ctx=n_ctx, n_slots=1, max_tokens=CHUNK)
    return f, spec, tok, model


def window_logits(model: Transformer, ids: list[int]):
    """Yield (ids chunk, logits (n, V) f32 on the host) for every chunk of `ids` run from
    position 0 in slot 0: logits row i predicts the token after chunk[i]."""
    be = model.backend
    dev = be.zeros((3 * CHUNK,), "int32")                               # (3C,) i32
    for c0 in range(0, len(ids), CHUNK):
        chunk = ids[c0:c0 + CHUNK]
        n = len(chunk)
        host = np.concatenate([chunk, np.arange(c0, c0 + n), np.zeros(n)]).astype(np.int32)
        be.upload_ints(host, dev[:3 * n])
        logits = model.forward(dev[:n], dev[n:2 * n], dev[2 * n:3 * n], c0 + n, n)  # (n, V)
        yield chunk, be.to_host(logits)


def generate_corpus(model: Transformer, bos: int | None, n_tokens: int, seed: int) -> list[int]:
    """n_tokens ids sampled from `model` at temperature 1 after BOS, one token per step."""
    rng = np.random.default_rng(seed)
    be = model.backend
    ids = [bos if bos is not None else 0]
    dev = be.zeros((3,), "int32")                                       # (3,) i32
    while len(ids) < n_tokens:
        pos = len(ids) - 1
        be.upload_ints(np.array([ids[-1], pos, 0], np.int32), dev)
        logits = be.to_host(model.forward(dev[:1], dev[1:2], dev[2:3], pos + 1, 1))[0]
        p = np.exp(logits.astype(np.float64) - logits.max())            # (V,) f64
        ids.append(int(rng.choice(len(p), p=p / p.sum())))
    return ids


# ---------------------------------------------------------------- the residual statistics
class ResidualSums:
    """Per prev token p: n_p and the sum of its residuals (V,), plus sum_t ||r_t||^2."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.index: dict[int, int] = {}
        self.sums = np.zeros((256, vocab), np.float32)                  # (cap, V) f32
        self.counts = np.zeros(256, np.int64)                           # (cap,)
        self.total_sq = 0.0
        self.n = 0

    def add(self, prev: list[int], r: np.ndarray) -> None:              # r (n, V) f32
        for p, row in zip(prev, r, strict=True):
            i = self.index.setdefault(int(p), len(self.index))
            if i == len(self.counts):
                self.sums = np.concatenate([self.sums, np.zeros_like(self.sums)])
                self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            self.sums[i] += row
            self.counts[i] += 1
        self.total_sq += float(np.einsum("ij,ij->", r, r, dtype=np.float64))
        self.n += len(prev)

    def means(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens (P,) i64, counts (P,) i64, mean residuals (P, V) f32), tokens in first-seen
        order."""
        P = len(self.index)
        toks = np.fromiter(self.index, np.int64, P)
        n = self.counts[:P]
        return toks, n, self.sums[:P] / n[:, None].astype(np.float32)


def fit_head(means: np.ndarray, counts: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(W1 rows of the seen tokens (P, R) f32, W2 (V, R) f32): the count-weighted rank-R least
    squares fit of `means` (P, V) (the module says how). Directions of zero weight give zero
    columns, so a rank above P fits exactly what P tokens allow."""
    w = np.sqrt(counts.astype(np.float64))                              # (P,)
    A = means * w[:, None].astype(np.float32)                           # (P, V) f32
    G = A.astype(np.float64) @ A.T.astype(np.float64)                   # (P, P) f64
    vals, vecs = np.linalg.eigh(G)                                      # ascending
    order = np.argsort(vals)[::-1][:rank]
    s2, U = vals[order], vecs[:, order]                                 # (r,), (P, r)
    keep = s2 > max(float(s2.max(initial=0.0)) * 1e-10, 1e-30)
    W2 = np.zeros((means.shape[1], rank), np.float64)                   # (V, R)
    W2[:, :keep.sum()] = (A.T.astype(np.float64) @ U[:, keep]) / np.sqrt(s2[keep])
    W1 = means.astype(np.float64) @ W2                                  # (P, R)
    return W1.astype(np.float32), W2.astype(np.float32)


def loss_after(sums: ResidualSums, toks: np.ndarray, counts: np.ndarray, means: np.ndarray,
               w1: np.ndarray, w2: np.ndarray) -> float:
    """Mean squared residual per logit with the head (W1 (V, R), W2 (V, R), as stored)."""
    total = sums.total_sq
    for p0 in range(0, len(toks), 256):
        c = w1[toks[p0:p0 + 256]].astype(np.float32) @ w2.T.astype(np.float32)  # (p, V) f32
        m, n = means[p0:p0 + 256], counts[p0:p0 + 256].astype(np.float64)
        total += float(n @ (np.einsum("ij,ij->i", c, c, dtype=np.float64)
                            - 2 * np.einsum("ij,ij->i", m, c, dtype=np.float64)))
    return total / (sums.n * sums.vocab)


# ---------------------------------------------------------------- writing
def write_head(draft: GGUFFile, out: Path, w1: np.ndarray, w2: np.ndarray, dtype: str) -> None:
    """A copy of `draft` with W1, W2 (V, R) as `dtype` and the head's metadata (an existing head
    and its metadata replaced)."""
    import gguf

    from service.gguf.writer import copy_metadata, write_tensor_data

    arch = draft.require("general.architecture", str)
    np_type, qtype = DTYPES[dtype]
    keys = {meta_key(arch, k) for k in ("enabled", "markov_rank", "vocab_size")}
    kept = [t for t in draft.tensors.values() if t.name not in (W1_NAME, W2_NAME)]
    new = [(W1_NAME, w1.astype(np_type)), (W2_NAME, w2.astype(np_type))]   # (V, R) each
    part = out.with_name(out.name + ".part")
    w = gguf.GGUFWriter(str(part), arch)
    try:
        copy_metadata(draft, w, None, None, drop=keys.__contains__)
        w.add_bool(meta_key(arch, "enabled"), True)
        w.add_uint32(meta_key(arch, "markov_rank"), int(w1.shape[1]))
        w.add_uint32(meta_key(arch, "vocab_size"), int(w1.shape[0]))
        for t in kept:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.raw.size,
                              raw_dtype=gguf.GGMLQuantizationType(int(t.qtype)))
        for name, a in new:
            w.add_tensor_info(name, a.shape, np.dtype(np.float32), a.nbytes,
                              raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
    except BaseException:
        w.close()
        part.unlink(missing_ok=True)
        raise
    write_tensor_data(w, [[t.raw] for t in kept] + [[a] for _, a in new], part, out)


# ---------------------------------------------------------------- the command
def _problems(rank: int, dtype: str, corpus: str, n_tokens: int | None, out: Path,
              draft: Path) -> list[tuple[str, str]]:
    problems = []
    if rank < 1:
        problems.append(("rank", f"{rank} is out of range; it must be at least 1"))
    if dtype not in DTYPES:
        problems.append(("dtype", f"unknown dtype {dtype!r}; one of " + ", ".join(DTYPES)))
    if corpus != GENERATE and not Path(corpus).is_file():
        problems.append(("corpus", f"{corpus!r} is not a file (or {GENERATE})"))
    if n_tokens is not None and n_tokens < 2:
        problems.append(("tokens", f"{n_tokens} is out of range; it must be at least 2"))
    if not out.parent.is_dir():
        problems.append(("out", f"{out.parent} is not a directory"))
    if out.exists() and draft.exists() and out.resolve() == draft.resolve():
        problems.append(("out", "the output would overwrite the draft file"))
    return problems


def fit_markov(target: str | os.PathLike, draft: str | os.PathLike, out: str | os.PathLike,
               rank: int, corpus: str, n_tokens: int | None = None, dtype: str = "f16",
               threads: int = 0, seed: int = 0) -> FitResult:
    """Fit a rank-`rank` head of `draft` to `target` over `corpus` (a text file, or GENERATE:
    n_tokens sampled from the target, 2048 by default) and write `out`."""
    target, draft, out = Path(target), Path(draft), Path(out)
    if problems := _problems(rank, dtype, corpus, n_tokens, out, draft):
        raise ConfigError(problems)
    t0 = time.perf_counter()
    tf, tspec, ttok, tmodel = load_cpu_model(target, threads)
    df, dspec, dtok, dmodel = load_cpu_model(draft, threads)
    n_ctx = min(tmodel.n_ctx, dmodel.n_ctx)
    check_draft_vocabulary(tf, tspec, ttok, df, dspec, dtok, n_ctx=0)
    if corpus == GENERATE:
        ids = generate_corpus(tmodel, ttok.bos_id, n_tokens or MAX_WINDOW, seed)
    else:
        ids = ttok.encode(Path(corpus).read_text(encoding="utf-8"))
        ids = ids[:n_tokens] if n_tokens else ids
    log.info("fit_markov_corpus", corpus=corpus, n_tokens=len(ids))
    sums = ResidualSums(tspec.vocab_size)
    for w0 in range(0, len(ids), n_ctx):
        window = ids[w0:w0 + n_ctx]
        for (chunk, t), (_, d) in zip(window_logits(tmodel, window),
                                      window_logits(dmodel, window), strict=True):
            r = t - d                                                   # (n, V) f32
            r -= r.mean(axis=1, keepdims=True)          # argmax ignores a per-row constant
            sums.add(chunk, r)
    toks, counts, means = sums.means()
    w1_seen, w2 = fit_head(means, counts, rank)
    w1 = np.zeros((tspec.vocab_size, rank), np.float32)                 # (V, R) f32
    w1[toks] = w1_seen
    np_type = DTYPES[dtype][0]
    w1, w2 = w1.astype(np_type), w2.astype(np_type)                     # as stored
    before = sums.total_sq / (sums.n * sums.vocab)
    after = loss_after(sums, toks, counts, means, w1, w2)
    write_head(df, out, w1, w2, dtype)
    return FitResult(out, rank, sums.n, len(toks), before, after, time.perf_counter() - t0)
