"""The DFlash draft forward on the host: a numpy float32 reference of llama.cpp's dflash graph
(the formulas in service/model/dflash.py), one sequence.

    encode(features)      g = rms_norm(fc @ f) * enc.output_norm, one row per target position
                          (f: the target's P tapped rows of that position, concatenated)
    inject(g, start)      every layer's context K/V rows at positions start..:
                              K_l = rope(rms_norm(Wk_l g) * k_norm_l),  V_l = Wv_l g
                          (llama.cpp's "embd batch" pass; the rows persist, like its draft cache)
    block(ids, n)         the block `ids` (B,) at positions n .. n + B - 1 over the context rows
                          [0, n): per layer l, with h = rms_norm(x) * attn_norm_l,
                              q = rope(rms_norm(Wq h) * q_norm), k = rope(rms_norm(Wk h) *
                              k_norm), v = Wv h; keys/values = [context rows; the block's rows]
                              a = softmax(q k^T / sqrt(hd) + mask) v   (mask: none, or causal
                              within the block with spec.causal); x += Wo a
                              x += W_down (silu(W_gate m) * (W_up m)),  m = rms_norm(x) * ffn_norm
                          logits = output @ (rms_norm(x) * output_norm)   (B, Vd), scattered to
                          (B, V) through d2t with -inf elsewhere; the block's K/V are not kept
    markov(logits, anchor)   DSpark's heads over a block's logits, row by row from
                          spec.first_draft_row: l_i += s W2 W1[prev_i] (through d2t), prev the
                          anchor, then each row's argmax target id; the confidence
                          c_i = sigmoid(conf_proj . [h_i ; W1[prev_i]] + b), h_i the block row's
                          rms_norm(x) * output_norm; the drafts are the rows' argmax
    draft(features, anchor, B)   encode + inject every feature row at 0.., then block([anchor,
                          mask x (B - 1)], n = rows): what common/speculative.cpp does for one
                          draft after a prefill (and markov for a DSpark drafter)

RoPE is NeoX's: pairs (i, i + d/2) of the first d = rope_dims dims, angle pos * base^(-2i/d).
Weights are dequantized to f32 once; the token embeddings and the output projection are the
drafter's own or the target's (its output.weight, else its tied token_embd). The oracle is
llama.cpp itself (tests/golden/test_dflash_oracle.py).
"""

from __future__ import annotations

import numpy as np

from service.gguf.quants import dequantize
from service.gguf.reader import GGUFFile
from service.model.dflash import (
    CONF_B,
    CONF_W,
    D2T,
    MARKOV_SCALE,
    MARKOV_W1,
    MARKOV_W2,
    DflashSpec,
)
from service.model.spec import ModelSpec


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32)
    r = np.float32(1.0) / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps))
    return (x * r * w).astype(np.float32)


def _load(f: GGUFFile, name: str, shape=None) -> np.ndarray:
    info = f.tensor(name, shape)
    return dequantize(info.raw, info.qtype, info.shape)


class DflashDraft:
    def __init__(self, spec: DflashSpec, f: GGUFFile, target: GGUFFile, n_ctx: int):
        spec.check_target(ModelSpec.from_gguf(target), str(f.path))
        self.spec, self.n_ctx = spec, n_ctx
        self.w = {n: _load(f, n, s) for n, s in spec.tensor_shapes().items() if n != D2T}
        self.embedding = self.w.get("token_embd.weight")                    # (V, E) f32
        if self.embedding is None:
            self.embedding = _load(target, "token_embd.weight")
        own = spec.output_name
        if own is not None:
            self.output = self.w[own]                                       # (Vd, E) f32
        else:
            tied = not target.has_tensor("output.weight")
            self.output = _load(target, "token_embd.weight" if tied else "output.weight")
        self.d2t = f.index_tensor(D2T) if spec.has_d2t else None            # (Vd,) i64
        s = spec
        kv = (s.n_layer, n_ctx, s.n_head_kv, s.head_dim)
        self.k = np.zeros(kv, np.float32)                                   # (L, C, Hkv, hd)
        self.v = np.zeros(kv, np.float32)                                   # (L, C, Hkv, hd)
        self.n_rows = 0                # context rows injected: positions [0, n_rows)
        self.hidden = np.zeros((0, s.n_embd), np.float32)  # (B, E) the last block's h rows
        inv = s.rope_base ** (-np.arange(0, s.rope_dims, 2, dtype=np.float64) / s.rope_dims)
        ang = np.arange(n_ctx, dtype=np.float64)[:, None] * inv[None, :]     # (C, d/2)
        self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    # ---------------------------------------------------------------- pieces
    def _rope(self, x: np.ndarray, pos: np.ndarray) -> None:
        """In place on (T, H, hd): NeoX RoPE over the first rope_dims dims."""
        d = self.spec.rope_dims
        c, s = self.cos[pos][:, None, :], self.sin[pos][:, None, :]        # (T, 1, d/2)
        a, b = x[..., : d // 2].copy(), x[..., d // 2:d].copy()
        x[..., : d // 2] = a * c - b * s
        x[..., d // 2:d] = a * s + b * c

    def _kv(self, i: int, h: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Layer i's K (roped, normed) and V rows of inputs h (T, E) at positions pos."""
        s, w, b = self.spec, self.w, f"blk.{i}."
        T = h.shape[0]
        k = (h @ w[b + "attn_k.weight"].T).reshape(T, s.n_head_kv, s.head_dim)  # (T, Hkv, hd)
        k = _rms(k, w[b + "attn_k_norm.weight"], s.rms_eps)
        self._rope(k, pos)
        v = (h @ w[b + "attn_v.weight"].T).reshape(T, s.n_head_kv, s.head_dim)  # (T, Hkv, hd)
        return k, v.astype(np.float32)

    # ---------------------------------------------------------------- the passes
    def encode(self, features: np.ndarray) -> np.ndarray:
        """features (T, P E) f32 (tapped target rows) -> g (T, E) f32."""
        f = np.asarray(features, np.float32)
        g = f @ self.w["fc.weight"].T                                       # (T, E)
        return _rms(g, self.w["enc.output_norm.weight"], self.spec.rms_eps)

    def inject(self, g: np.ndarray, start: int) -> None:
        """Every layer's context K/V rows from g (T, E) at positions start .. start + T - 1."""
        T = g.shape[0]
        if g.shape != (T, self.spec.n_embd) or not 0 <= start <= self.n_ctx - T:
            raise ValueError(f"inject: g {g.shape}, start {start} (context {self.n_ctx})")
        pos = np.arange(start, start + T)
        for i in range(self.spec.n_layer):
            self.k[i, pos], self.v[i, pos] = self._kv(i, g, pos)
        self.n_rows = max(self.n_rows, start + T)

    def block(self, ids, n: int) -> np.ndarray:
        """Logits (B, V) f32 of the block `ids` (B,) at positions n.. over context rows [0, n);
        -inf off the draft vocabulary when the file has d2t."""
        s, w, eps = self.spec, self.w, self.spec.rms_eps
        ids = np.asarray(ids, np.int64)
        B = len(ids)
        if not 0 <= n <= self.n_rows or n + B > self.n_ctx:
            raise ValueError(f"block: {B} ids at {n}, {self.n_rows} context rows, context "
                             f"{self.n_ctx}")
        pos = np.arange(n, n + B)
        H, Hkv, hd = s.n_head, s.n_head_kv, s.head_dim
        # key j of the n + B visible to query t: context rows all, block rows j <= t if causal
        seen = np.ones((B, n + B), bool)
        if s.causal:
            seen[:, n:] = np.tril(np.ones((B, B), bool))
        x = self.embedding[ids].astype(np.float32)                          # (B, E)
        for i in range(s.n_layer):
            b = f"blk.{i}."
            h = _rms(x, w[b + "attn_norm.weight"], eps)                     # (B, E)
            q = (h @ w[b + "attn_q.weight"].T).reshape(B, H, hd)            # (B, H, hd)
            q = _rms(q, w[b + "attn_q_norm.weight"], eps)
            self._rope(q, pos)
            kb, vb = self._kv(i, h, pos)                                    # (B, Hkv, hd) x2
            kk = np.concatenate([self.k[i, :n], kb])                        # (n + B, Hkv, hd)
            vv = np.concatenate([self.v[i, :n], vb])                        # (n + B, Hkv, hd)
            kk, vv = np.repeat(kk, H // Hkv, axis=1), np.repeat(vv, H // Hkv, axis=1)
            sc = np.einsum("thd,jhd->htj", q, kk) / np.float32(np.sqrt(hd))  # (H, B, n + B)
            sc = np.where(seen[None], sc, -np.inf)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            a = np.einsum("htj,jhd->thd", p, vv).reshape(B, H * hd)        # (B, H hd)
            x = (x + a @ w[b + "attn_output.weight"].T).astype(np.float32)  # (B, E)
            m = _rms(x, w[b + "ffn_norm.weight"], eps)                      # (B, E)
            gate, up = m @ w[b + "ffn_gate.weight"].T, m @ w[b + "ffn_up.weight"].T  # (B, F)
            act = gate / (np.float32(1.0) + np.exp(-gate)) * up             # (B, F)
            x = (x + act @ w[b + "ffn_down.weight"].T).astype(np.float32)   # (B, E)
        self.hidden = _rms(x, w["output_norm.weight"], eps)                 # (B, E)
        out = (self.hidden @ self.output.T).astype(np.float32)              # (B, Vd)
        if self.d2t is None:
            return out                                                      # (B, V)
        logits = np.full((B, s.vocab_size), -np.inf, np.float32)            # (B, V)
        logits[:, self.d2t] = out
        return logits

    def markov(self, logits: np.ndarray, anchor: int
               ) -> tuple[np.ndarray, list[int], np.ndarray | None]:
        """DSpark's heads over the last block's logits (B, V) (from block(), whose anchor is
        `anchor`): the biased logits (B, V) (rows before spec.first_draft_row unchanged), the
        drafts (the argmax chain, target ids, one per row from first_draft_row) and the
        confidences (one per draft row; None without the confidence head)."""
        s, w = self.spec, self.w
        if not s.dspark:
            raise ValueError("markov: not a DSpark drafter")
        w1, w2 = w[MARKOV_W1], w[MARKOV_W2]                                 # (V, R), (Vd, R)
        scale = np.float32(w[MARKOV_SCALE][0]) if s.markov_scale else np.float32(1.0)
        out, prev, drafts, conf = logits.astype(np.float32), int(anchor), [], []
        for i in range(s.first_draft_row, logits.shape[0]):
            r = w1[prev]                                                    # (R,)
            bias = (w2 @ r) * scale                                         # (Vd,)
            out[i, self.d2t if self.d2t is not None else slice(None)] += bias
            if s.confidence:
                z = np.float32(w[CONF_W][0] @ np.concatenate([self.hidden[i], r]))
                z += w[CONF_B][0] if s.confidence_bias else 0
                conf.append(np.float32(1) / (np.float32(1) + np.exp(-z)))
            prev = int(out[i].argmax())
            drafts.append(prev)
        return out, drafts, np.array(conf, np.float32) if s.confidence else None

    def draft(self, features: np.ndarray, anchor: int, B: int | None = None) -> np.ndarray:
        """One draft after a prefill: inject the T feature rows at positions 0 .. T - 1, then
        the block [anchor, mask x (B - 1)] at position T (B: the trained block size).
        Logits (B, V); row 0 (the anchor's) is not a draft, unless the drafter is anchor-first
        DSpark (whose rows are the Markov head's)."""
        B = B or self.spec.block_size
        g = self.encode(features)                                           # (T, E)
        self.inject(g, 0)
        ids = [anchor] + [self.spec.mask_token] * (B - 1)
        logits = self.block(ids, g.shape[0])
        return self.markov(logits, anchor)[0] if self.spec.dspark else logits
