"""The operations of an EAGLE-3 head with their backward passes, in numpy (`train-drafter`).

Each forward returns its output and what its backward needs; each backward takes the output's
gradient and returns the inputs' and the weights' gradients. Any float dtype: training runs
float32, the gradient check float64. The formulas are those of service/model/eagle3_forward.py
(the reference the served drafter is held to); the backward passes are:

    rms:      n = x r, r = (mean x^2 + eps)^-1/2, y = n w
              dw = sum_rows dy n;  dx = r (u - n mean(u n)),  u = dy w
    rope:     a rotation by +theta per pair (2i, 2i + 1); its gradient rotates by -theta
    swiglu:   a = silu(gate) up, silu'(x) = s(x) (1 + x (1 - s(x))), s the logistic function
    softmax cross-entropy: dlogits = weight (softmax - onehot(label))

Attention is the training-time-test kind (EAGLE-3's): the rows of unroll step k at position P
are the draft chain's k-th row. Their queries see the real-feature rows (step 0's keys) at
positions <= P - k and, for each step j = 1..k, the one key of step j at position P - k + j
(the chain rows drafted before them); step 0 is plain causal attention. Heads are grouped as in
llama.cpp's GQA: query head h reads KV head h // (H / Hkv).
"""

from __future__ import annotations

import numpy as np

# ---------------------------------------------------------------- RMS norm


def rms_forward(x: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, tuple]:
    """y = x / rms(x) * w over the last axis."""
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)          # (..., 1)
    n = x * r                                                           # (..., D)
    return n * w, (n, r, w)


def rms_backward(dy: np.ndarray, cache: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(dx, dw) of rms_forward."""
    n, r, w = cache
    u = dy * w                                                          # (..., D)
    dx = r * (u - n * (u * n).mean(-1, keepdims=True))                  # (..., D)
    dw = (dy * n).reshape(-1, n.shape[-1]).sum(0)                       # (D,)
    return dx, dw


# ---------------------------------------------------------------- RoPE (normal kind)


def rope_tables(n_pos: int, dims: int, base: float, dtype) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (n_pos, dims / 2) of the angles pos * base^(-2i / dims)."""
    inv = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)       # (d/2,) f64
    ang = np.arange(n_pos, dtype=np.float64)[:, None] * inv[None, :]     # (n_pos, d/2) f64
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dims: int) -> np.ndarray:
    """x (B, T, H, hd) rotated at positions 0..T-1 (cos, sin (T, d/2)); a new array. The
    backward is rope with -sin."""
    out = x.copy()
    c, s = cos[None, :, None, :], sin[None, :, None, :]                 # (1, T, 1, d/2)
    a, b = x[..., 0:dims:2], x[..., 1:dims:2]                           # (B, T, H, d/2)
    out[..., 0:dims:2] = a * c - b * s
    out[..., 1:dims:2] = a * s + b * c
    return out


# ---------------------------------------------------------------- attention


def shift(x: np.ndarray, s: int) -> np.ndarray:
    """x moved s positions later along axis 1: out[:, P] = x[:, P - s], 0 where P < s."""
    if s == 0:
        return x
    out = np.zeros_like(x)
    out[:, s:] = x[:, :x.shape[1] - s]
    return out


def unshift(dx: np.ndarray, s: int) -> np.ndarray:
    """The gradient of shift: out[:, P] = dx[:, P + s]."""
    if s == 0:
        return dx
    out = np.zeros_like(dx)
    out[:, :dx.shape[1] - s] = dx[:, s:]
    return out


def _grouped(q: np.ndarray, n_kv: int) -> np.ndarray:
    """q (B, T, H, hd) -> (B, Hkv, G, T, hd), G = H / Hkv."""
    B, T, H, hd = q.shape
    return q.reshape(B, T, n_kv, H // n_kv, hd).transpose(0, 2, 3, 1, 4)


def _mask(T: int, k: int) -> np.ndarray:
    """(T, T + k) bool: step-0 keys at p' <= P - k, then step j's key (column T + j - 1) where
    P - k + j >= 0."""
    P = np.arange(T)[:, None]
    causal = np.arange(T)[None, :] <= P - k                             # (T, T)
    diag = (P - k + np.arange(1, k + 1)[None, :]) >= 0                  # (T, k)
    return np.concatenate([causal, diag], axis=1)


def attention_forward(q: np.ndarray, keys: list[np.ndarray], vals: list[np.ndarray]
                      ) -> tuple[np.ndarray, tuple]:
    """Unroll step k = len(keys) - 1: q (B, T, H, hd), keys/vals[j] (B, T, Hkv, hd) of steps
    0..k -> out (B, T, H, hd) (module doc)."""
    B, T, H, hd = q.shape
    k, n_kv = len(keys) - 1, keys[0].shape[2]
    qg = _grouped(q, n_kv) / np.sqrt(hd).astype(q.dtype)                # (B, Hkv, G, T, hd)
    G = H // n_kv
    k0 = keys[0].transpose(0, 2, 3, 1)[:, :, None]                      # (B, Hkv, 1, hd, T)
    sc = [qg @ k0]                                                      # (B, Hkv, G, T, T)
    dk = [shift(keys[j], k - j).transpose(0, 2, 1, 3)[:, :, None] for j in range(1, k + 1)]
    sc += [(qg * d).sum(-1)[..., None] for d in dk]                     # (B, Hkv, G, T, 1)
    s = np.concatenate(sc, axis=-1)                                     # (B, Hkv, G, T, T+k)
    s = np.where(_mask(T, k), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)                                       # (B, Hkv, G, T, T+k)
    v0 = vals[0].transpose(0, 2, 1, 3)[:, :, None]                      # (B, Hkv, 1, T, hd)
    dv = [shift(vals[j], k - j).transpose(0, 2, 1, 3)[:, :, None] for j in range(1, k + 1)]
    o = p[..., :T] @ v0                                                 # (B, Hkv, G, T, hd)
    for j, d in enumerate(dv):
        o = o + p[..., T + j:T + j + 1] * d
    out = o.transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)               # (B, T, H, hd)
    return out, (qg, k0, dk, v0, dv, p, G)


def attention_backward(dout: np.ndarray, cache: tuple
                       ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """(dq (B, T, H, hd), dkeys[j], dvals[j] (B, T, Hkv, hd)) of attention_forward."""
    qg, k0, dk, v0, dv, p, G = cache
    B, n_kv, _, T, hd = qg.shape
    k = len(dk)
    do = _grouped(dout, n_kv)                                           # (B, Hkv, G, T, hd)
    dp = [do @ v0.swapaxes(-1, -2)]                                     # (B, Hkv, G, T, T)
    dp += [(do * d).sum(-1)[..., None] for d in dv]                     # (B, Hkv, G, T, 1)
    dp = np.concatenate(dp, axis=-1)                                    # (B, Hkv, G, T, T+k)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))                     # (B, Hkv, G, T, T+k)
    dqg = ds[..., :T] @ k0.swapaxes(-1, -2)                             # (B, Hkv, G, T, hd)
    dk0 = (ds[..., :T].swapaxes(-1, -2) @ qg).sum(2)                    # (B, Hkv, T, hd)
    dv0 = (p[..., :T].swapaxes(-1, -2) @ do).sum(2)                     # (B, Hkv, T, hd)
    dkeys, dvals = [dk0.transpose(0, 2, 1, 3)], [dv0.transpose(0, 2, 1, 3)]
    for j in range(k):
        w = ds[..., T + j:T + j + 1]                                    # (B, Hkv, G, T, 1)
        dqg = dqg + w * dk[j]
        dkj = (w * qg).sum(2).transpose(0, 2, 1, 3)                     # (B, T, Hkv, hd)
        dvj = (p[..., T + j:T + j + 1] * do).sum(2).transpose(0, 2, 1, 3)
        dkeys.append(unshift(dkj, k - j - 1))
        dvals.append(unshift(dvj, k - j - 1))
    dq = (dqg / np.sqrt(hd).astype(dqg.dtype)).transpose(0, 3, 1, 2, 4)  # (B, T, Hkv, G, hd)
    return dq.reshape(B, T, n_kv * G, hd), dkeys, dvals


# ---------------------------------------------------------------- SwiGLU, cross-entropy


def swiglu_forward(gate: np.ndarray, up: np.ndarray) -> tuple[np.ndarray, tuple]:
    """silu(gate) * up."""
    s = 1.0 / (1.0 + np.exp(-gate))                                     # (..., F)
    return gate * s * up, (gate, up, s)


def swiglu_backward(da: np.ndarray, cache: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(dgate, dup) of swiglu_forward."""
    gate, up, s = cache
    dgate = da * up * s * (1.0 + gate * (1.0 - s))
    return dgate, da * gate * s


def cross_entropy(logits: np.ndarray, labels: np.ndarray, weight: np.ndarray
                  ) -> tuple[float, np.ndarray, np.ndarray]:
    """Weighted softmax cross-entropy over rows: logits (N, Vd), labels (N,) (any value where
    weight is 0), weight (N,). Returns (sum of weight * loss, dlogits of that sum (N, Vd),
    the argmax per row (N,))."""
    m = logits.max(-1, keepdims=True)
    e = np.exp(logits - m)                                              # (N, Vd)
    z = e.sum(-1, keepdims=True)
    rows = np.arange(len(labels))
    lab = np.where(weight > 0, labels, 0)
    nll = (np.log(z[:, 0]) + m[:, 0] - logits[rows, lab]) * weight      # (N,)
    d = e / z                                                           # (N, Vd) softmax
    d[rows, lab] -= 1.0
    d *= weight[:, None]
    return float(nll.sum()), d, logits.argmax(-1)


def soft_cross_entropy(logits: np.ndarray, ids: np.ndarray, probs: np.ndarray,
                       weight: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Weighted cross-entropy against sparse target distributions: logits (N, Vd), ids (N, K)
    draft-vocabulary indices (any value where probs is 0), probs (N, K) summing to 1 per row
    with weight > 0, weight (N,). Row loss -sum_j p_j log softmax(logits)[ids_j] = logsumexp -
    sum_j p_j logits[ids_j]; its gradient softmax(logits) - p scattered onto the ids. Returns
    (sum of weight * loss, dlogits of that sum (N, Vd), the argmax per row (N,))."""
    m = logits.max(-1, keepdims=True)
    e = np.exp(logits - m)                                              # (N, Vd)
    z = e.sum(-1, keepdims=True)
    p = np.where(weight[:, None] > 0, probs, 0).astype(logits.dtype)    # (N, K)
    idx = np.where(p > 0, ids, 0)                                       # (N, K)
    rows = np.arange(len(idx))[:, None]
    nll = (np.log(z[:, 0]) + m[:, 0]) * p.sum(-1) - (p * logits[rows, idx]).sum(-1)
    d = e / z                                                           # (N, Vd) softmax
    d *= p.sum(-1)[:, None]
    np.add.at(d, (np.broadcast_to(rows, idx.shape), idx), -p)
    d *= weight[:, None]
    return float((nll * weight).sum()), d, logits.argmax(-1)
