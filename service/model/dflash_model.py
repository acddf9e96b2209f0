"""The DFlash drafter on a backend: its encoder with the K/V injection, and the block decoder
over its own KV cache, written with the backend ops the target's transformer uses (the formulas
in dflash.py; dflash_forward.py is the numpy reference it is tested against).

    inject(features, positions, slots)   g = rms_norm(fc @ f) * enc.output_norm; per layer l:
                                         k|v = g @ Wkv_l, k = rms_norm(k) * k_norm_l, NeoX RoPE,
                                         written at (slots, positions)    the context rows
    block(ids, positions, slots, n)      the block rows (T = len(ids)) at positions n .. n+T-1
        of one sequence: x = embed(ids); per layer h = rms_norm(x) * attn_norm; q = h @ Wq,
        k|v = h @ Wkv; q/k norms, RoPE and the block's K/V written at n..n+T-1 (rows a later
        inject overwrites); attention over the context rows [0, n) and the block's rows (all
        of them, or j <= t with spec.causal: attn_lo = n, attn_mask = the block's bits);
        x += a @ Wo; x += down(silu(gate m) * up m), m = rms_norm(x) * ffn_norm
        logits = rms_norm(x) * output_norm @ Wout    (T, Vd)
The block is at most MAX_BLOCK rows (the attention mask's 32 bits). The logits are over the
draft vocabulary (Vd rows of the output): with d2t, draft id i is target id d2t[i] (`d2t`, a
host array); mapping the chosen ids is the drafter's business. A DSpark drafter's heads
(service/model/dspark_heads.py, `heads`) run on the block's logits and its final hidden rows
(`hidden`, valid until the next block). Every buffer is allocated at
construction; a call only slices. The model shares the target's backend: its construction sizes
the backend's step scratch again over both models' matrices, so it comes before any step.
"""

from __future__ import annotations

import numpy as np

from service.backends.base import Backend
from service.gguf.reader import GGUFFile
from service.model.dflash import D2T, DflashSpec
from service.model.dspark_heads import DsparkHeads
from service.model.transformer import Transformer
from service.model.weights import _fused

MAX_BLOCK = 32                # attention masks are 32 bits wide (backends/base.py)


class DflashModel:
    def __init__(self, spec: DflashSpec, f: GGUFFile, target: Transformer, *, n_ctx: int,
                 n_slots: int, max_tokens: int, type_k: str = "f16", type_v: str = "f16"):
        spec.check_target(target.spec, str(f.path))
        be: Backend = target.backend
        self.spec, self.backend, self.max_tokens = spec, be, max_tokens
        self.max_block = min(MAX_BLOCK, spec.block_size, max_tokens)
        t, vec = f.tensor, lambda name: be.load_vector(f.tensor(name))
        self.fc = be.load_matrix([t("fc.weight")])                       # (E, P E)
        self.enc_norm, self.output_norm = vec("enc.output_norm.weight"), vec("output_norm.weight")
        self.layers = []
        for i in range(spec.n_layer):
            b = f"blk.{i}."
            self.layers.append({
                "attn_norm": vec(b + "attn_norm.weight"), "ffn_norm": vec(b + "ffn_norm.weight"),
                "q_norm": vec(b + "attn_q_norm.weight"), "k_norm": vec(b + "attn_k_norm.weight"),
                "q": be.load_matrix([t(b + "attn_q.weight")]),            # (Q, E)
                "kv": _fused(be, [t(b + "attn_k.weight"), t(b + "attn_v.weight")]),  # (2K, E)
                "wo": be.load_matrix([t(b + "attn_output.weight")]),      # (E, Q)
                "gate_up": _fused(be, [t(b + "ffn_gate.weight"), t(b + "ffn_up.weight")]),
                "down": be.load_matrix([t(b + "ffn_down.weight")])})      # (E, F)
        self.embedding = (be.load_embedding(t("token_embd.weight")) if spec.own_embedding
                          else target.weights.embedding)
        own = spec.output_name
        self.output = (be.load_matrix([t(own)]) if own is not None
                       else target.weights.output)                      # (Vd, E)
        self.d2t = f.index_tensor(D2T) if spec.has_d2t else None        # (Vd,) i64 host
        s, m, z = spec, max_tokens, be.zeros
        self.cache = be.new_kv_cache(s.n_layer, n_slots, n_ctx, s.n_head_kv, s.head_dim,
                                     s.head_dim, type_k, type_v)
        self.rope = be.rope_table(n_ctx, s.rope_dims, s.rope_base)
        self.Q, self.K = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
        self.ws_g = z((m, s.n_embd))                                      # (M, E) f32 fused
        self.ws_x = z((m, s.n_embd))                                      # (M, E) f32 residual
        self.ws_n = z((m, s.n_embd))                                      # (M, E) f32 normed
        self.ws_o = z((m, s.n_embd))                                      # (M, E) f32 scratch
        self.ws_q = z((m, self.Q))                                        # (M, Q) f32
        self.ws_kv = z((m, 2 * self.K))                                   # (M, 2K) f32
        self.ws_attn = z((m, self.Q))                                     # (M, Q) f32
        self.ws_gu = z((m, 2 * s.n_ff))                                   # (M, 2F) f32
        self.ws_act = z((m, s.n_ff))                                      # (M, F) f32
        self.ws_logits = z((self.max_block, s.draft_vocab))               # (B, Vd) f32
        self.ws_lo = z((self.max_block,), "int32")                        # (B,) i32 attn_lo
        self.ws_mask = z((self.max_block,), "int32")                      # (B,) i32 attn_mask
        self.heads = DsparkHeads(spec, f, be, self.max_block) if spec.dspark else None
        # the backend's scratch was sized for the target's matrices: again over the drafter's
        # (its fc is P E wide), before any step runs
        target.prepare_backend()

    def hidden(self, T: int):
        """The last block's final hidden rows rms_norm(x) * output_norm (T, E) f32 (the output
        projection's input), until the next inject or block."""
        return self.ws_n[:T]

    def _kv(self, layer: dict, h, T: int) -> None:
        """ws_kv[:T] = h (T, E) @ Wkv_l^T: the layer's k|v (T, 2K)."""
        kv = self.ws_kv[:T]
        for w, c0, c1 in layer["kv"]:
            self.backend.matmul(h, w, kv[:, c0:c1])                      # (T, 2K)

    def _store_kv(self, layer: dict, T: int, positions, slots, index: int) -> None:
        """ws_kv[:T]'s k normed and roped, k and v written at (slots, positions) of layer
        `index`."""
        s, be = self.spec, self.backend
        kv = self.ws_kv[:T]
        k = kv[:, :self.K].reshape(T, s.n_head_kv, s.head_dim)           # (T, Hkv, hd)
        v = kv[:, self.K:].reshape(T, s.n_head_kv, s.head_dim)           # (T, Hkv, hd)
        be.rms_norm(k, layer["k_norm"], s.rms_eps, k)
        be.rope(k, positions, self.rope, True)
        be.kv_write(self.cache, index, k, v, slots, positions)

    def inject(self, features, positions, slots) -> None:
        """Context rows from features (T, P E) f32 at (slots, positions), T <= max_tokens; all
        three backend arrays (positions, slots (T,) int32)."""
        s, be = self.spec, self.backend
        T = features.shape[0]
        if not 1 <= T <= self.max_tokens:
            raise ValueError(f"DFlash inject of {T} rows (max {self.max_tokens})")
        g, n = self.ws_g[:T], self.ws_n[:T]
        be.matmul(features, self.fc, g)                                  # (T, E)
        be.rms_norm(g, self.enc_norm, s.rms_eps, n)                      # (T, E) every layer's
        for i, layer in enumerate(self.layers):
            self._kv(layer, n, T)
            self._store_kv(layer, T, positions, slots, i)

    def block_bounds(self, T: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The attention bounds of a block of T rows after n context rows: attn_lo (T,) and
        attn_mask (T,) int32 host arrays (all the block's rows, or j <= t when causal)."""
        bits = [(1 << (t + 1)) - 1 if self.spec.causal else (1 << T) - 1 for t in range(T)]
        return np.full(T, n, np.int32), np.array(bits, np.uint32).view(np.int32)

    def block(self, ids, positions, slots, n: int, lo=None, mask=None):
        """Logits (T, Vd) of the block ids (T,) at positions n .. n + T - 1 of one sequence
        (positions, slots (T,) int32 backend arrays holding those positions and its slot) over
        its context rows [0, n). lo, mask: block_bounds(T, n) already on the backend ((T,)
        int32 each: a captured block uploads nothing); None: uploaded here."""
        s, be, eps = self.spec, self.backend, self.spec.rms_eps
        T, hd, F = len(ids), s.head_dim, s.n_ff
        if not 1 <= T <= self.max_block:
            raise ValueError(f"DFlash block of {T} rows (max {self.max_block})")
        if lo is None:
            lo, mask = self.ws_lo[:T], self.ws_mask[:T]
            host_lo, host_mask = self.block_bounds(T, n)
            be.upload_ints(host_lo, lo)
            be.upload_ints(host_mask, mask)
        x, h, o = self.ws_x[:T], self.ws_n[:T], self.ws_o[:T]
        be.embed(self.embedding, ids, 1.0, x)                            # (T, E)
        for i, layer in enumerate(self.layers):
            be.rms_norm_for_matmul(x, layer["attn_norm"], eps, h)        # (T, E)
            q = self.ws_q[:T]
            be.matmul(h, layer["q"], q)                                  # (T, Q)
            self._kv(layer, h, T)                                        # (T, 2K)
            q3 = q.reshape(T, s.n_head, hd)                              # (T, H, hd)
            be.rms_norm(q3, layer["q_norm"], eps, q3)
            be.rope(q3, positions, self.rope, True)
            self._store_kv(layer, T, positions, slots, i)
            a = self.ws_attn[:T]
            be.attention_for_matmul(q3, self.cache, i, slots, positions, n + T, 0,
                                    1.0 / float(np.sqrt(hd)), a.reshape(T, s.n_head, hd),
                                    lo, mask)
            be.matmul_add(a, layer["wo"], x, o)                          # x += a Wo^T
            be.rms_norm_for_matmul(x, layer["ffn_norm"], eps, h)         # (T, E)
            gu, act = self.ws_gu[:T], self.ws_act[:T]
            for w, c0, c1 in layer["gate_up"]:
                be.matmul(h, w, gu[:, c0:c1])                            # (T, 2F)
            be.glu_for_matmul(gu[:, :F], gu[:, F:], "silu", act)         # (T, F)
            be.matmul_add(act, layer["down"], x, o)                      # x += down
        be.rms_norm_for_matmul(x, self.output_norm, eps, h)              # (T, E)
        logits = self.ws_logits[:T]
        be.matmul(h, self.output, logits)                                # (T, Vd)
        return logits
