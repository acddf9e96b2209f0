"""Fitting an EAGLE-3 head to a target's sequences (`train-drafter`): the draft vocabulary, the
initial weights, batches, Adam, and the held-out measures (loss, acceptance per depth).

Rows. A sequence of T tokens has tapped rows and target choices at positions 0..T-2
(eagle3_data.TargetSequence). Head row P (0 <= P <= T-3) reads token ids[P + 1] and features
f[P] and is labeled with choice[P + 1], the target's next token after ids[P + 1] (the alignment
llama.cpp and the engine's drafter use: the row at P predicts the token at P + 2). Its token
was chosen by the target when ids[P + 1] == choice[P]; a chain's k-th draft at row P counts only
when rows P - k + 1..P all were (eagle3_head.py), which holds throughout a generation and not in
general inside a prompt.

Soft labels (`--soft-labels N`): a row's loss target is the target's distribution over its N
most likely next tokens (kept at generation) restricted to the draft vocabulary and
renormalized, in place of the one-hot of its choice. The reported measures (loss, acceptance)
stay against the choice.

Draft vocabulary (d2t): the `n` target ids most frequent among the training rows' labels (ties
to the lower id), sorted; 0 keeps the whole vocabulary. Labels outside it weigh 0 in the loss
and count as misses in the acceptance.

Initial weights (seeded): the output projection is the target's output rows of the draft
vocabulary (its tied embeddings where it has no output.weight), output_norm the target's output
norm; the other norms 1; every other matrix normal with standard deviation 1 / sqrt(fan in),
the two that write into the residual (attn_output, ffn_down) half that, and fc scaled by 1 /
rms(features) so that g starts at unit scale whatever the target's residual scale.

Acceptance at depth d, over start rows P of the generated part (P >= n_prompt - 2: the extend's
last row after the prompt and after every later commit) with rows P + 1..P + D - 1 chosen by
the target (D the deepest depth measured): the fraction whose chain's drafts 1..d are all the
target's choices. Draft j is unroll step j - 1's argmax at row P + j - 1, the same number the
chain computes on its own outputs when drafts 1..j-1 are right (eagle3_head.py). 1 + the sum
over depths is the expected tokens per verify step of a chain of D drafts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog

from service.gguf.quants import dequantize
from service.gguf.reader import GGUFFile
from service.model.eagle3 import Eagle3Spec
from service.tools.eagle3_data import TargetSequence
from service.tools.eagle3_head import FC, N_ENC, N_OUT, OUT, WO, Batch, Eagle3Head, trained_names

log = structlog.get_logger("specstream.train_drafter")

HALF_STD = (WO, "blk.0.ffn_down.weight")


# ---------------------------------------------------------------- vocabulary and weights
def draft_vocab(seqs: Sequence[TargetSequence], vocab: int, n: int) -> np.ndarray | None:
    """d2t (n,) i64: the n most frequent label ids of the rows, sorted; None for n = 0."""
    if n == 0:
        return None
    counts = np.zeros(vocab, np.int64)                                  # (V,)
    for s in seqs:
        np.add.at(counts, s.choice[1:], 1)
    order = np.lexsort((np.arange(vocab), -counts))                     # count desc, id asc
    return np.sort(order[:n]).astype(np.int64)


def target_to_draft(d2t: np.ndarray | None, vocab: int) -> np.ndarray:
    """(V,) i64: each target id's draft row, -1 outside the draft vocabulary."""
    if d2t is None:
        return np.arange(vocab, dtype=np.int64)
    t2d = np.full(vocab, -1, np.int64)
    t2d[d2t] = np.arange(len(d2t))
    return t2d


def target_tensor(f: GGUFFile, name: str) -> np.ndarray:
    info = f.tensor(name)
    return dequantize(info.raw, info.qtype, info.shape).astype(np.float32)


def initial_params(spec: Eagle3Spec, target: GGUFFile, d2t: np.ndarray | None,
                   feat_rms: float, seed: int) -> dict[str, np.ndarray]:
    """The head's starting weights, f32 (module doc)."""
    rng = np.random.default_rng(seed)
    shapes = spec.tensor_shapes()
    out_name = "output.weight" if target.has_tensor("output.weight") else "token_embd.weight"
    out = {}
    for name in trained_names(spec):
        shape = shapes[name]
        if name == OUT:
            rows = target_tensor(target, out_name)                      # (V, E) f32
            out[name] = rows if d2t is None else rows[d2t]              # (Vd, E) f32
        elif name == N_OUT:
            out[name] = target_tensor(target, "output_norm.weight")     # (E,) f32
        elif len(shape) == 1:
            out[name] = np.ones(shape, np.float32)
        else:
            std = 1.0 / np.sqrt(shape[1])
            if name in HALF_STD:
                std /= 2
            if name == FC and not spec.norm_before_fc:
                std /= max(feat_rms, 1e-6)
            out[name] = (rng.standard_normal(shape) * std).astype(np.float32)
    if N_ENC in out:
        out[N_ENC][:] = 1.0
    return out


# ---------------------------------------------------------------- batches
def rows_of(s: TargetSequence) -> tuple[np.ndarray, ...]:
    """A sequence's head rows: (feats (R, 3 Et), tokens (R,), labels (R,) target ids, chosen
    (R,) bool), R = T - 2."""
    R = len(s.ids) - 2
    return (s.feats[:R], s.ids[1:R + 1], s.choice[1:R + 1],
            s.ids[1:R + 1] == s.choice[:R])


def make_batch(seqs: Sequence[TargetSequence], t2d: np.ndarray, n_steps: int,
               dtype=np.float32, soft: bool = False) -> Batch:
    """The sequences as one padded batch with weights for n_steps unroll steps; soft: with
    soft labels from the sequences' top tokens (soft_labels)."""
    rows = [rows_of(s) for s in seqs]
    B, T = len(rows), max(1, *(len(r[1]) for r in rows))
    feats = np.zeros((B, T, rows[0][0].shape[1]), dtype)                # (B, T, 3 Et)
    tokens = np.zeros((B, T), np.int64)
    labels = np.full((B, T), -1, np.int64)
    weight = np.zeros((n_steps, B, T), dtype)                           # (K, B, T)
    for b, (f, tok, lab, chosen) in enumerate(rows):
        R = len(tok)
        feats[b, :R], tokens[b, :R], labels[b, :R] = f, tok, t2d[lab]
        for k in range(n_steps):
            weight[k, b, :R] = (labels[b, :R] >= 0) & _chain_ok(chosen, k)
    if not soft:
        return Batch(feats, tokens, labels, weight)
    n = seqs[0].top_ids.shape[1]
    soft_ids = np.zeros((B, T, n), np.int64)                            # (B, T, n)
    soft_p = np.zeros((B, T, n), dtype)                                 # (B, T, n)
    for b, s in enumerate(seqs):
        R = len(rows[b][1])
        soft_ids[b, :R], soft_p[b, :R] = soft_labels(s, t2d)
    return Batch(feats, tokens, labels, weight, soft_ids, soft_p)


def soft_labels(s: TargetSequence, t2d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A sequence's head rows' soft labels (module doc): (draft ids (R, n) i64, 0 where unused,
    probabilities (R, n) f32)."""
    R = len(s.ids) - 2
    top, logp = s.top_ids[1:R + 1], s.top_logp[1:R + 1]                # (R, n) each
    d = np.where(top >= 0, t2d[np.maximum(top, 0)], -1)                 # (R, n) i64
    lp = np.where(d >= 0, logp, -np.inf).astype(np.float64)            # (R, n) f64
    m = lp.max(-1, keepdims=True)
    p = np.exp(lp - np.where(np.isfinite(m), m, 0.0))                   # (R, n) f64
    z = p.sum(-1, keepdims=True)
    return np.maximum(d, 0), (p / np.where(z > 0, z, 1.0)).astype(np.float32)


def _chain_ok(chosen: np.ndarray, k: int) -> np.ndarray:
    """(R,) bool: row P >= k and chosen[P - k + 1..P] all true (k = 0: every row)."""
    R = len(chosen)
    ok = np.arange(R) >= k
    for i in range(k):
        ok[k:] &= chosen[k - i:R - i]
    return ok


def batches(seqs: Sequence[TargetSequence], size: int, rng: np.random.Generator | None
            ) -> list[list[TargetSequence]]:
    """Groups of `size` sequences (shuffled by rng; None: in order)."""
    order = np.arange(len(seqs)) if rng is None else rng.permutation(len(seqs))
    return [[seqs[i] for i in order[b:b + size]] for b in range(0, len(seqs), size)]


# ---------------------------------------------------------------- Adam
@dataclass
class Adam:
    """Adam with the global gradient norm clipped to `clip` and decoupled weight decay on the
    2-D parameters (p -= lr * weight_decay * p before the step, AdamW); the learning rate is
    set per step by the caller (warmup, then linear decay)."""

    params: dict[str, np.ndarray]
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0
    weight_decay: float = 0.0   # decoupled (AdamW), on the matrices only (not the norms)
    t: int = 0
    m: dict = field(default_factory=dict)
    v: dict = field(default_factory=dict)

    def step(self, grads: dict[str, np.ndarray], lr: float) -> float:
        """Update params in place; returns the gradient norm before clipping."""
        norm = float(np.sqrt(sum(float((g * g).sum()) for g in grads.values())))
        scale = min(1.0, self.clip / max(norm, 1e-12))
        self.t += 1
        c1, c2 = 1 - self.beta1 ** self.t, 1 - self.beta2 ** self.t
        for name, g in grads.items():
            g = g * scale
            m = self.m.setdefault(name, np.zeros_like(g))
            v = self.v.setdefault(name, np.zeros_like(g))
            m *= self.beta1
            m += (1 - self.beta1) * g
            v *= self.beta2
            v += (1 - self.beta2) * g * g
            p = self.params[name]
            if self.weight_decay and p.ndim >= 2:
                p -= (lr * self.weight_decay) * p
            p -= (lr / c1) * m / (np.sqrt(v / c2) + self.eps)
        return norm


def schedule(step: int, total: int, lr: float, warmup: float = 0.05) -> float:
    """Linear warmup over the first `warmup` of the steps, then linear decay to lr / 10."""
    w = max(1, int(total * warmup))
    if step < w:
        return lr * (step + 1) / w
    return lr * (1.0 - 0.9 * (step - w) / max(1, total - w))


# ---------------------------------------------------------------- measures
@dataclass(frozen=True)
class Measure:
    loss: np.ndarray          # (K,) mean cross-entropy per unroll step over the weighted rows
    acceptance: np.ndarray    # (D,) chain acceptance per depth (module doc)
    starts: int               # start rows the acceptance counts


def acceptance_starts(s: TargetSequence, depth: int) -> np.ndarray:
    """The start rows of a sequence the acceptance counts (module doc)."""
    _, tok, _, chosen = rows_of(s)
    R = len(tok)
    P = np.arange(max(0, s.n_prompt - 2), R - depth + 1)
    ok = np.ones(len(P), bool)
    for j in range(1, depth):
        ok &= chosen[P + j]
    return P[ok]


def measure(head: Eagle3Head, seqs: Sequence[TargetSequence], t2d: np.ndarray, n_steps: int,
            depth: int, batch: int = 8) -> Measure:
    """Loss per unroll step and the chain's acceptance per depth over `seqs`."""
    K = max(n_steps, depth)
    losses, norms = np.zeros(K), np.zeros(K)
    hits, starts = np.zeros(depth), 0
    for group in batches(seqs, batch, None):
        b = make_batch(group, t2d, K, head.dtype)
        loss, pred = head.evaluate(b)                                   # (K,), (K, B, T)
        losses += loss
        norms += b.weight.sum((1, 2))
        right = (pred == b.labels[None]) & (b.labels[None] >= 0)        # (K, B, T)
        for i, s in enumerate(group):
            P = acceptance_starts(s, depth)
            run = np.ones(len(P), bool)
            for j in range(depth):
                run &= right[j, i, P + j]
                hits[j] += run.sum()
            starts += len(P)
    return Measure((losses / np.maximum(norms, 1))[:n_steps], hits / max(starts, 1), starts)


# ---------------------------------------------------------------- the training loop
@dataclass(frozen=True)
class FitOptions:
    unroll: int = 1           # unroll steps trained (1: the extend only)
    epochs: int = 4
    batch: int = 8            # sequences per step
    lr: float = 1e-3
    max_seconds: float = 0.0  # > 0: fewer steps, so that training ends in about this time
    seed: int = 0
    soft: bool = False        # train on soft labels (the sequences carry their top tokens)
    weight_decay: float = 0.0  # AdamW's, on the matrices


@dataclass(frozen=True)
class FitResult:
    steps: int
    seconds: float
    loss: np.ndarray          # (K,) mean training loss per unroll step over the last epoch


def fit(head: Eagle3Head, seqs: Sequence[TargetSequence], t2d: np.ndarray, opts: FitOptions,
        on_epoch: Callable[[int, np.ndarray], None] | None = None) -> FitResult:
    """Train head.p in place with Adam over `opts.epochs` passes of shuffled batches. With
    max_seconds, the step count is cut after the first steps' time so that the schedule
    (warmup, linear decay) still ends at its last step."""
    rng = np.random.default_rng(opts.seed)
    per_epoch = -(-len(seqs) // opts.batch)
    total = opts.epochs * per_epoch
    adam, step, t0 = Adam(head.p, weight_decay=opts.weight_decay), 0, time.perf_counter()
    sums = norms = np.zeros(opts.unroll)
    for epoch in range(opts.epochs):
        sums, norms = np.zeros(opts.unroll), np.zeros(opts.unroll)
        for group in batches(seqs, opts.batch, rng):
            if step >= total:
                break
            b = make_batch(group, t2d, opts.unroll, head.dtype, opts.soft)
            losses, _, grads = head.loss_and_grads(b)
            adam.step(grads, schedule(step, total, opts.lr))
            step += 1
            sums, norms = sums + losses, norms + b.weight.sum((1, 2))
            if opts.max_seconds > 0 and step == 3:
                per_step = (time.perf_counter() - t0) / step
                total = max(step, min(total, int(opts.max_seconds / per_step)))
        mean = sums / np.maximum(norms, 1)
        log.info("epoch", epoch=epoch + 1, steps=step, loss=[round(float(x), 3) for x in mean],
                 seconds=round(time.perf_counter() - t0, 1))
        if on_epoch is not None:
            on_epoch(epoch + 1, mean)
        if step >= total:
            break
    return FitResult(step, time.perf_counter() - t0, sums / np.maximum(norms, 1))
