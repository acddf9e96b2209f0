"""An EAGLE-3 head's loss and gradients over a batch of training sequences, unrolled as a draft
chain (`train-drafter`; the operations and their backward passes: eagle3_ops.py).

A batch holds B sequences padded to T rows. Row P of a sequence stands for the drafter row at
position P: input token t[P + 1], the target's three tapped rows f[P] (3 Et), and as label the
target's choice at position P + 1 (its argmax there: the token a verify step accepts), as an
index into the draft vocabulary (-1: outside it). Unroll step 0 is the extend: g = fc @ f, over
every row with causal attention. Step k > 0 is the k-th draft of a chain (training-time test):
its row P reads the same token with g = step k - 1's pre-norm output y at P - 1 (the chain feeds
y back), and attends to the real rows at <= P - k and to the one row of each step 1..k the
chain wrote before it (eagle3_ops.attention_forward). Its label is row P's: a chain's k-th draft
is right when its earlier drafts were, so the tokens it reads are the real ones.

    loss = sum_k (sum over rows of weight_k * CE(logits_k, label)) / sum weight_k

With soft labels (Batch.soft_p) a row's CE is against the target's distribution over its top
draft ids, -sum_j p_j log softmax(logits)[id_j], whose gradient is softmax - p: the row learns
the target's alternatives and their odds, not only its argmax.

weight_k (K, B, T) is 0 on padding, unlabeled rows and rows whose chain would read a token the
target did not choose. The token embeddings are the target's and stay frozen; every other
tensor of the file (Eagle3Spec.tensor_shapes, d2t aside) is trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.model.eagle3 import D2T, Eagle3Spec
from service.tools import eagle3_ops as ops

FROZEN = ("token_embd.weight", D2T, "rope_freqs.weight")
WQ, WK, WV, WO = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
              "blk.0.attn_output.weight")
GATE, UP, DOWN = "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"
N_TOK, N_FEAT, N_FFN, N_OUT, N_ENC = ("blk.0.attn_norm.weight", "blk.0.attn_norm_2.weight",
                                      "blk.0.ffn_norm.weight", "output_norm.weight",
                                      "enc.output_norm.weight")
FC, OUT = "fc.weight", "output.weight"


def trained_names(spec: Eagle3Spec) -> list[str]:
    """The tensors training updates, in the file's order."""
    return [n for n in spec.tensor_shapes() if n not in FROZEN]


@dataclass(frozen=True)
class Batch:
    feats: np.ndarray         # (B, T, 3 Et) the target's tapped rows f[P]
    tokens: np.ndarray        # (B, T) int64 input token t[P + 1] (0 on padding)
    labels: np.ndarray        # (B, T) int64 draft-vocabulary index of the label, -1: none
    weight: np.ndarray        # (K, B, T) per unroll step: 1 where the row's loss counts
    # soft labels (None: the one-hot of labels): the target's distribution over a few draft
    # ids per row, the loss's target in place of the label (which stays the accuracy's)
    soft_ids: np.ndarray | None = None    # (B, T, N) int64 draft-vocabulary indices
    soft_p: np.ndarray | None = None      # (B, T, N) probabilities, 0 on unused entries

    def loss(self, logits: np.ndarray, k: int, dtype) -> tuple[float, np.ndarray, np.ndarray]:
        """Unroll step k's weighted cross-entropy of logits (B, T, Vd) against the labels
        (soft or hard): (sum, dlogits (B T, Vd), argmax (B T,))."""
        flat = logits.reshape(-1, logits.shape[-1])
        w = self.weight[k].reshape(-1).astype(dtype)
        if self.soft_p is None:
            return ops.cross_entropy(flat, self.labels.reshape(-1), w)
        n = self.soft_p.shape[-1]
        return ops.soft_cross_entropy(flat, self.soft_ids.reshape(-1, n),
                                      self.soft_p.reshape(-1, n), w)


def lin(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (..., D) @ w.T for w (O, D): one GEMM over the flattened rows -> (..., O)."""
    return (x.reshape(-1, x.shape[-1]) @ w.T).reshape(*x.shape[:-1], w.shape[0])


def wgrad(dy: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The gradient of w in y = lin(x, w): dy^T x over the flattened rows -> (O, D)."""
    return dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])


class Eagle3Head:
    """The trained tensors (`params`, one dtype) and the frozen token embeddings of a head."""

    def __init__(self, spec: Eagle3Spec, params: dict[str, np.ndarray], embedding: np.ndarray,
                 max_len: int):
        self.spec, self.p = spec, params
        self.dtype = params[FC].dtype
        self.embedding = embedding.astype(self.dtype, copy=False)       # (V, E)
        self.eps = self.dtype.type(spec.rms_eps)
        self.cos, self.sin = ops.rope_tables(max_len, spec.rope_dims, spec.rope_base,
                                             self.dtype)                # (L, d/2) each

    # ------------------------------------------------------------ forward
    def _encode(self, feats: np.ndarray) -> tuple[np.ndarray, tuple]:
        f = feats.astype(self.dtype, copy=False)                        # (B, T, 3 Et)
        c = None
        if self.spec.norm_before_fc:
            f, c = ops.rms_forward(f, self.p[N_ENC], self.eps)
        return lin(f, self.p[FC]), (f, c)                               # (B, T, E)

    def _rope(self, x: np.ndarray, back: bool = False) -> np.ndarray:
        T = x.shape[1]
        sin = -self.sin[:T] if back else self.sin[:T]
        return ops.rope(x, self.cos[:T], sin, self.spec.rope_dims)

    def _step(self, g: np.ndarray, e: np.ndarray, keys: list, vals: list):
        """One unroll step over g (B, T, E): (y (B, T, E), logits (B, T, Vd), cache); appends
        its keys and values."""
        s, p, eps = self.spec, self.p, self.eps
        B, T, _ = g.shape
        gn, c_gn = ops.rms_forward(g, p[N_FEAT], eps)                   # (B, T, E)
        h = np.concatenate([e, gn], axis=-1)                            # (B, T, 2E)
        q = self._rope(lin(h, p[WQ]).reshape(B, T, s.n_head, s.head_dim))  # (B, T, H, hd)
        keys.append(self._rope(lin(h, p[WK]).reshape(B, T, s.n_head_kv, s.head_dim)))
        vals.append(lin(h, p[WV]).reshape(B, T, s.n_head_kv, s.head_dim))  # (B, T, Hkv, hd)
        a, c_att = ops.attention_forward(q, keys, vals)                 # (B, T, H, hd)
        a = a.reshape(B, T, -1)                                         # (B, T, H hd)
        r = lin(a, p[WO]) + (gn if s.norm_before_residual else g)       # (B, T, E)
        m, c_m = ops.rms_forward(r, p[N_FFN], eps)                      # (B, T, E)
        act, c_act = ops.swiglu_forward(lin(m, p[GATE]), lin(m, p[UP]))  # (B, T, F)
        y = r + lin(act, p[DOWN])                                       # (B, T, E)
        z, c_z = ops.rms_forward(y, p[N_OUT], eps)                      # (B, T, E)
        logits = lin(z, p[OUT])                                         # (B, T, Vd)
        return y, logits, (h, c_gn, c_att, a, m, c_m, act, c_act, z, c_z)

    def _inputs(self, batch: Batch) -> tuple[np.ndarray, np.ndarray, tuple]:
        """(g (B, T, E) from the features, the normed token embeddings (B, T, E), their
        caches)."""
        g, c_enc = self._encode(batch.feats)
        e, c_e = ops.rms_forward(self.embedding[batch.tokens], self.p[N_TOK], self.eps)
        return g, e, (c_enc, c_e)

    def _unrolled(self, g: np.ndarray, e: np.ndarray, n_steps: int):
        """Yield (y, logits, cache) for unroll steps 0..n_steps-1 from step 0's g."""
        keys: list = []
        vals: list = []
        for _ in range(n_steps):
            y, logits, cache = self._step(g, e, keys, vals)
            yield y, logits, (cache, keys, vals)
            g = ops.shift(y, 1)                                         # g_k+1[P] = y_k[P-1]

    def logits(self, batch: Batch, n_steps: int) -> list[np.ndarray]:
        """Every row's draft-vocabulary logits (B, T, Vd) at unroll steps 0..n_steps-1."""
        g, e, _ = self._inputs(batch)
        return [lg for _, lg, _ in self._unrolled(g, e, n_steps)]

    def evaluate(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """Forward only, over weight's K unroll steps: (the summed weighted cross-entropy per
        step (K,), every row's argmax draft-vocabulary index per step (K, B, T))."""
        n_steps = batch.weight.shape[0]
        losses, preds = np.zeros(n_steps), []
        for k, logits in enumerate(self.logits(batch, n_steps)):
            losses[k], _, top = batch.loss(logits, k, self.dtype)
            preds.append(top.reshape(batch.labels.shape))
        return losses, np.stack(preds)

    # ------------------------------------------------------------ loss and gradients
    def loss_and_grads(self, batch: Batch) -> tuple[np.ndarray, np.ndarray, dict]:
        """Per unroll step (weight's K): the summed weighted cross-entropy (K,), the correct
        argmax count (K,), and the gradients of the loss (module doc) for every trained
        tensor."""
        n_steps = batch.weight.shape[0]
        norm = np.maximum(batch.weight.sum((1, 2)), 1.0)                # (K,)
        caches, losses, hits = [], np.zeros(n_steps), np.zeros(n_steps)
        labels = batch.labels.reshape(-1)
        g, e, head_cache = self._inputs(batch)
        for k, (y, logits, cache) in enumerate(self._unrolled(g, e, n_steps)):
            losses[k], dlogits, top = batch.loss(logits, k, self.dtype)
            hits[k] = float(((top == labels) & (batch.weight[k].reshape(-1) > 0)).sum())
            caches.append((y, (dlogits / norm[k]).reshape(logits.shape), cache))
        grads = {n: np.zeros_like(self.p[n]) for n in trained_names(self.spec)}
        self._backward(caches, e, head_cache, grads)
        return losses, hits, grads

    def _backward(self, caches: list, e: np.ndarray, head_cache: tuple, grads: dict) -> None:
        n_steps = len(caches)
        keys, vals = caches[-1][2][1], caches[-1][2][2]
        dkeys = [np.zeros_like(x) for x in keys]
        dvals = [np.zeros_like(x) for x in vals]
        dy = np.zeros_like(caches[-1][0])                               # (B, T, E)
        de = np.zeros_like(e)                                           # (B, T, E)
        for k in reversed(range(n_steps)):
            y, dlogits, (cache, _, _) = caches[k]
            dg, de_k = self._step_backward(k, dy, dlogits, cache, dkeys, dvals, grads)
            de += de_k
            dy = ops.unshift(dg, 1) if k else dg
        c_enc, c_e = head_cache
        grads[N_TOK] += ops.rms_backward(de, c_e)[1]
        f, c = c_enc
        grads[FC] += wgrad(dy, f)
        if self.spec.norm_before_fc:
            grads[N_ENC] += ops.rms_backward(lin(dy, self.p[FC].T), c)[1]

    def _step_backward(self, k: int, dy: np.ndarray, dlogits: np.ndarray, cache: tuple,
                       dkeys: list, dvals: list, grads: dict) -> tuple[np.ndarray, np.ndarray]:
        """Step k's backward given dy from the next step (B, T, E): returns (dg, de)."""
        s, p = self.spec, self.p
        h, c_gn, c_att, a, m, c_m, act, c_act, z, c_z = cache
        B, T, E = dy.shape
        grads[OUT] += wgrad(dlogits, z)
        dz = lin(dlogits, p[OUT].T)                                     # (B, T, E)
        dyz, dw = ops.rms_backward(dz, c_z)
        grads[N_OUT] += dw
        dr = dy + dyz                                                   # (B, T, E)
        grads[DOWN] += wgrad(dr, act)
        dgate, dup = ops.swiglu_backward(lin(dr, p[DOWN].T), c_act)     # (B, T, F) each
        grads[GATE] += wgrad(dgate, m)
        grads[UP] += wgrad(dup, m)
        dm, dw = ops.rms_backward(lin(dgate, p[GATE].T) + lin(dup, p[UP].T), c_m)
        grads[N_FFN] += dw
        dr = dr + dm
        grads[WO] += wgrad(dr, a)
        dq, dks, dvs = ops.attention_backward(lin(dr, p[WO].T).reshape(B, T, s.n_head, -1),
                                              c_att)
        for j in range(k + 1):
            dkeys[j] += dks[j]
            dvals[j] += dvs[j]
        dq = self._rope(dq, back=True).reshape(B, T, -1)                # (B, T, H hd)
        dk = self._rope(dkeys[k], back=True).reshape(B, T, -1)          # (B, T, Hkv hd)
        dv = dvals[k].reshape(B, T, -1)                                 # (B, T, Hkv hd)
        grads[WQ] += wgrad(dq, h)
        grads[WK] += wgrad(dk, h)
        grads[WV] += wgrad(dv, h)
        dh = lin(dq, p[WQ].T) + lin(dk, p[WK].T) + lin(dv, p[WV].T)     # (B, T, 2E)
        dgn = dh[..., E:] + (dr if s.norm_before_residual else 0.0)
        dg, dw = ops.rms_backward(dgn, c_gn)
        grads[N_FEAT] += dw
        return (dg if s.norm_before_residual else dg + dr), dh[..., :E]
