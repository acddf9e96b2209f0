"""The EAGLE-3 draft forward on the host: a numpy float32 reference of llama.cpp's eagle3 graph
(the formulas in service/model/eagle3.py), one sequence, with the drafter's own KV rows.

    encode(features)        g = fc @ f (f = the target's three rows, normed first with
                            norm_before_fc): one row per target token
    decode(ids, g, start)   the one decoder block over tokens ids at positions start.., each
                            conditioned on its g row; writes KV rows start..; returns the
                            logits (T, V) (-inf off the draft vocabulary when the file has d2t)
                            and the pre-norm outputs y (T, E), a draft chain's next g rows

Weights are dequantized to f32 once; the token embeddings and the output projection are the
drafter's own or the target's (the target's output, or its tied embeddings). RoPE is the normal
kind (pairs 2i, 2i + 1; llama.cpp's converter permutes q and k for it), angles pos *
base^(-2i / rope_dims) divided by rope_freqs[i] where the file has them. The oracle the engine's
eagle3 drafter is tested against (tests/engine/test_eagle3_drafter.py).
"""

from __future__ import annotations

import numpy as np

from service.gguf.quants import dequantize
from service.gguf.reader import GGUFFile
from service.model.eagle3 import D2T, Eagle3Spec
from service.model.spec import ModelSpec


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32)
    r = np.float32(1.0) / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps))
    return (x * r * w).astype(np.float32)


class Eagle3Draft:
    def __init__(self, spec: Eagle3Spec, f: GGUFFile, target: GGUFFile, n_ctx: int):
        t = ModelSpec.from_gguf(target)
        spec.check_target(t, str(f.path))
        self.spec, self.n_ctx = spec, n_ctx
        load = {}
        for name, shape in spec.tensor_shapes().items():
            if name != D2T:
                info = f.tensor(name, shape)
                load[name] = dequantize(info.raw, info.qtype, info.shape)
        self.w = load
        self.embedding = load.get("token_embd.weight")                  # (V, E) f32
        if self.embedding is None:
            self.embedding = self._target(target, "token_embd.weight")
        self.output = load.get("output.weight")                         # (Vd, E) f32
        if self.output is None:
            name = "output.weight" if target.has_tensor("output.weight") else "token_embd.weight"
            self.output = self._target(target, name)
        self.d2t = f.index_tensor(D2T) if spec.has_d2t else None        # (Vd,) i64
        s = spec
        self.k = np.zeros((n_ctx, s.n_head_kv, s.head_dim), np.float32)  # (C, Hkv, hd)
        self.v = np.zeros((n_ctx, s.n_head_kv, s.head_dim), np.float32)  # (C, Hkv, hd)
        inv = s.rope_base ** (-np.arange(0, s.rope_dims, 2, dtype=np.float64) / s.rope_dims)
        if s.has_rope_freqs:
            inv = inv / load["rope_freqs.weight"].astype(np.float64)
        ang = np.arange(n_ctx, dtype=np.float64)[:, None] * inv[None, :]  # (C, d/2)
        self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    @staticmethod
    def _target(target: GGUFFile, name: str) -> np.ndarray:
        info = target.tensor(name)
        return dequantize(info.raw, info.qtype, info.shape)

    def encode(self, features: np.ndarray) -> np.ndarray:
        """features (T, 3 Et) f32 (a tapped target step's rows) -> g (T, E) f32."""
        f = np.asarray(features, np.float32)
        if self.spec.norm_before_fc:
            f = _rms(f, self.w["enc.output_norm.weight"], self.spec.rms_eps)
        return (f @ self.w["fc.weight"].T).astype(np.float32)              # (T, E)

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> None:
        """In place on (T, H, hd): normal RoPE over the first rope_dims dims."""
        d = self.spec.rope_dims
        c, s = self.cos[pos][:, None, :], self.sin[pos][:, None, :]      # (T, 1, d/2)
        a, b = x[..., 0:d:2].copy(), x[..., 1:d:2].copy()
        x[..., 0:d:2] = a * c - b * s
        x[..., 1:d:2] = a * s + b * c

    def decode(self, ids, g: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens `ids` (T,) at positions start.., conditioned on g (T, E): (logits (T, V),
        y (T, E)), both f32; writes the KV rows start..start+T-1."""
        s, w, eps = self.spec, self.w, self.spec.rms_eps
        ids = np.asarray(ids, np.int64)
        T = len(ids)
        if g.shape != (T, s.n_embd) or not 0 <= start <= self.n_ctx - T:
            raise ValueError(f"decode: {T} ids, g {g.shape}, start {start} (context "
                             f"{self.n_ctx})")
        pos = np.arange(start, start + T)
        g = np.asarray(g, np.float32)
        e = _rms(self.embedding[ids], w["blk.0.attn_norm.weight"], eps)    # (T, E)
        gn = _rms(g, w["blk.0.attn_norm_2.weight"], eps)                    # (T, E)
        h = np.concatenate([e, gn], axis=1)                                 # (T, 2E)
        H, Hkv, hd = s.n_head, s.n_head_kv, s.head_dim
        q = (h @ w["blk.0.attn_q.weight"].T).reshape(T, H, hd)             # (T, H, hd)
        k = (h @ w["blk.0.attn_k.weight"].T).reshape(T, Hkv, hd)           # (T, Hkv, hd)
        v = (h @ w["blk.0.attn_v.weight"].T).reshape(T, Hkv, hd)           # (T, Hkv, hd)
        self._rope(q, pos)
        self._rope(k, pos)
        self.k[pos], self.v[pos] = k, v
        n = start + T
        kk = np.repeat(self.k[:n], H // Hkv, axis=1)                        # (n, H, hd)
        vv = np.repeat(self.v[:n], H // Hkv, axis=1)                        # (n, H, hd)
        sc = np.einsum("thd,nhd->htn", q, kk) / np.float32(np.sqrt(hd))     # (H, T, n)
        sc = np.where(np.arange(n)[None, None, :] <= pos[None, :, None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        a = np.einsum("htn,nhd->thd", p, vv).reshape(T, H * hd)            # (T, H*hd)
        r = (a @ w["blk.0.attn_output.weight"].T).astype(np.float32)        # (T, E)
        r += gn if s.norm_before_residual else g
        m = _rms(r, w["blk.0.ffn_norm.weight"], eps)                        # (T, E)
        gate, up = m @ w["blk.0.ffn_gate.weight"].T, m @ w["blk.0.ffn_up.weight"].T
        act = gate / (np.float32(1.0) + np.exp(-gate)) * up                 # (T, F)
        y = (r + act @ w["blk.0.ffn_down.weight"].T).astype(np.float32)     # (T, E)
        out = _rms(y, w["output_norm.weight"], eps) @ self.output.T         # (T, Vd)
        if self.d2t is None:
            return out.astype(np.float32), y
        logits = np.full((T, s.vocab_size), -np.inf, np.float32)           # (T, V)
        logits[:, self.d2t] = out
        return logits, y
