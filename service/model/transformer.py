"""The decoder-only transformer, written once against the backend interface.

One `forward` call is one engine step: T tokens (1 <= T <= max_tokens) of any mix of sequences,
each with its position and KV slot. All activations live in a workspace allocated at load time;
a step only slices it, so the same sequence of ops (and, on the GPU, the same captured graph)
serves every step with the same (T, kv_len).

Per layer (architecture differences come from ModelSpec.traits and ModelSpec.layers as data):
    h = rms_norm(x) ; q|k|v|g = h @ Wqkvg (+ bias) ; q,k = rms_norm_per_head(q,k) if qk_norm
    q,k = rope(q,k) ; cache[slot, pos] = k,v ; a = attention(q, cache)
      (cache[slot, pos]: the pool row the paged cache's block table gives, base.py)
    a *= softplus(g) if the layer has an attention gate (per head or per element)
    o = a @ Wo ; x += post_norm(o) if post_norms else o
    h = rms_norm(x) ; o = down(act(gate(h)) * up(h))  or  mixture of experts (+ shared expert)
    x += post_norm(o) if post_norms else o
The query head count, RoPE table and FFN kind (dense or MoE) are the layer's (LayerSpec).
logits = rms_norm(x) @ Wout
A step given a hidden-state tap (hidden.py) also copies x as it enters each named layer (and the
final x) into the tap's buffer, inside the same step.
written with the backend's fused ops (base.py), whose defaults are exactly the separate ops: a
norm or GLU that feeds a matmul, q/k norm + RoPE + KV write as one op, the residual add fused
into the output and down projections (post-norm + add as one op where there are post-norms).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from service.backends.base import Backend, segment_rows
from service.gguf.reader import GGUFFile
from service.model.hidden import HiddenOut
from service.model.spec import ModelSpec, RopeMode
from service.model.weights import load_weights


class Transformer:
    def __init__(self, spec: ModelSpec, f: GGUFFile, backend: Backend, *, n_ctx: int,
                 n_slots: int, max_tokens: int, type_k: str = "f16", type_v: str = "f16",
                 max_logits: int | None = None, kv_blocks: int | Callable[[], int] = 0,
                 block_size: int = 16):
        self.spec, self.backend = spec, backend
        self.file = f         # its weights' file (a drafter sharing its embeddings gathers rows)
        self.n_ctx, self.n_slots, self.max_tokens = n_ctx, n_slots, max_tokens
        self.max_logits = max_tokens if max_logits is None else min(max_logits, max_tokens)
        self.weights = load_weights(spec, f, backend)
        # paged: kv_blocks blocks of block_size positions (0: every slot a full context); a
        # callable is asked once the weights are loaded (a pool sized by the memory left)
        if callable(kv_blocks):
            kv_blocks = kv_blocks()
        self.cache = backend.new_kv_cache(spec.n_layer, n_slots, n_ctx, spec.n_head_kv,
                                          spec.head_dim, spec.head_dim_v, type_k, type_v,
                                          kv_blocks, block_size)
        tables: dict = {}
        for layer in spec.layers:
            key = (layer.rope_dims, layer.rope_base, layer.rope_scaling)
            if key not in tables:
                tables[key] = backend.rope_table(n_ctx, *key)
        self.rope_tables = [tables[(la.rope_dims, la.rope_base, la.rope_scaling)]
                            for la in spec.layers]
        s, m, z = spec, max_tokens, backend.zeros
        self.k_dim, self.v_dim = s.n_head_kv * s.head_dim, s.n_head_kv * s.head_dim_v
        qkvg = max(la.n_head * (s.head_dim + la.attn_gate) for la in s.layers)
        moe = s.moe
        ffs = [s.n_ff if not la.moe else moe.n_ff_expert for la in s.layers]
        ff = max(ffs + [moe.n_ff_shared if moe else 0])
        self.ws_x = z((m, s.n_embd))                                    # (M, E) f32 residual
        self.ws_h = z((m, s.n_embd))                                    # (M, E) f32 normed
        self.ws_o = z((m, s.n_embd))                                    # (M, E) f32 block out
        self.ws_o2 = z((m, s.n_embd)) if moe and moe.n_ff_shared else None   # shared expert
        # per-layer widths vary (query heads, gate, FFN): flat buffers, viewed as (T, width)
        # contiguous rows by _rows
        self.ws_qkv = z((m * (qkvg + self.k_dim + self.v_dim),))       # (T, Q+K+V+G) f32
        self.ws_attn = z((m * s.n_head * s.head_dim_v,))                # (T, H*Dv) f32
        self.ws_gu = z((m * 2 * ff,))                                   # (T, 2F) f32 gate|up
        self.ws_act = z((m * ff,))                                      # (T, F) f32
        self.ws_logits = z((self.max_logits, s.vocab_size))             # (L, V) f32
        self._prepare_args = dict(
            max_tokens=m, n_head=s.n_head, head_dim_v=s.head_dim_v, n_ctx=n_ctx,
            n_embd=s.n_embd, moe_experts=moe.n_expert if moe else 0,
            moe_used=moe.n_expert_used if moe else 0, moe_ff=moe.n_ff_expert if moe else 0)
        self.prepare_backend()

    def prepare_backend(self) -> None:
        """Size the backend's step scratch for this model's steps over every matrix loaded on
        the backend so far: again after a part sharing the backend (an EAGLE-3 head) loaded
        wider matrices, before any step runs."""
        self.backend.prepare(**self._prepare_args)

    @staticmethod
    def _rows(flat, T: int, width: int):
        """The first T rows of `width` of a flat workspace buffer: (T, width), contiguous."""
        return flat[:T * width].reshape(T, width)

    def set_block_table(self, host) -> None:
        """The KV cache's block table (n_slots, max_blocks) int32 (base.py's paging rule), for
        the steps after this call."""
        self.backend.set_block_table(self.cache, host)

    def _matmuls(self, x, parts, out, segments=None) -> None:
        for w, c0, c1 in parts:
            self.backend.matmul(x, w, out[:, c0:c1], segments)

    def forward(self, ids, positions, slots, kv_len: int, n_logits: int = 1, epilogue=None,
                kv_positions=None, attn_lo=None, attn_mask=None,
                hidden: HiddenOut | None = None, segments: Segmented | None = None,
                tag: str | None = None):
        """Run one step; return logits (n_logits, V) for the last n_logits tokens.

        ids, positions, slots: (T,) int32 backend arrays; padding rows have slot -1.
        kv_positions, attn_lo, attn_mask: optional (T,) int32 backend arrays for tree verify
        rows (base.py): where each row's K/V goes and which KV rows it sees; all three or none.
        kv_len must then also exceed every kv_positions entry.
        kv_len >= every real position + 1 (read by the CPU backend only). `epilogue(logits)`,
        when given, runs right after the step inside the same `run_step` (token choice), so a
        backend that captures the step captures it too. The backend may capture the step per
        (T, n_logits) and replay it: everything that changes between steps of one shape is read
        from ids, positions, slots and the cache.
        `hidden`: also copy the residual rows at the tap's points into hidden.buf (hidden.py);
        such a step is keyed apart, so steps without a tap run exactly the ops they did.
        `segments`: the step is several runs of rows (prompts' chunks, each padded alone),
        each computed as a step of its own rows would compute it (Segmented); the logits are
        then those of the rows segments.logit_rows names, in that order.
        `tag`: a caller's name for an epilogue that differs from its other steps' of the same
        shape (the runner's steps that sample later): such steps are keyed apart.
        """
        T = len(ids)
        if not 1 <= T <= self.max_tokens or not 0 <= n_logits <= min(T, self.max_logits):
            raise ValueError(f"step of {T} tokens / {n_logits} logits outside the workspace "
                             f"(max {self.max_tokens} / {self.max_logits})")

        tree = (kv_positions, attn_lo, attn_mask)
        if any(a is None for a in tree) and any(a is not None for a in tree):
            raise ValueError("kv_positions, attn_lo and attn_mask come together")

        taps = self._taps(hidden, T, n_logits)
        if segments is not None:
            segments.check(T, n_logits)
            if hidden is not None:
                raise ValueError("a segmented step copies no hidden states")

        def step():
            logits = self._forward(ids, positions, slots, kv_len, n_logits, *tree, taps=taps,
                                   segments=segments)
            if epilogue is not None:
                epilogue(logits)
            return logits

        inputs = (ids, positions, slots, *(a for a in tree if a is not None))
        tagged = () if tag is None else (tag,)
        if segments is not None:
            return self.backend.run_step((T, n_logits, "segments", segments, *tagged), inputs,
                                         step)
        if hidden is None:
            return self.backend.run_step((T, n_logits, *tagged), inputs, step)
        return self.backend.run_step((T, n_logits, "hidden", hidden.tap, *tagged),
                                     (*inputs, hidden.buf), step)

    def _taps(self, hidden: HiddenOut | None, T: int, n_logits: int) -> dict:
        """point k -> (residual rows to copy, their buffer view): the copies of one step."""
        if hidden is None:
            return {}
        s = self.spec
        hidden.tap.check(s.n_layer)
        lo, hi = hidden.rows(T, n_logits)
        E, buf = s.n_embd, hidden.buf
        if buf.shape[0] < hi - lo or buf.shape[1] != hidden.tap.width(E):
            raise ValueError(f"hidden-state buffer {tuple(buf.shape)}: at least "
                             f"({hi - lo}, {hidden.tap.width(E)}) wanted")
        x = self.ws_x
        return {k: (x[lo:hi], buf[:hi - lo, j * E:(j + 1) * E])      # (R, E), (R, E) f32
                for j, k in enumerate(hidden.tap.points)}

    def forward_chain(self, ids, positions, slots, kv_lens, epilogue, prologue=None) -> None:
        """Run n = len(ids) single-token steps as ONE backend step, keyed (1, 1, "chain", n):
        `prologue()` first, then for i = 0..n-1 the forward of token ids[i] at positions[i] in
        slots[i] (kv_len kv_lens[i]) and `epilogue(i, logits (1, V))`.

        ids, positions, slots: (n,) int32 backend arrays; kv_lens: n host ints (CPU only).
        Each forward reads its id from the backend when it runs, so the prologue or an earlier
        epilogue may write it there (a draft chain: step i's choice is step i + 1's input), and
        a backend that captures the step captures the whole chain, one graph per n.
        """
        n, kv = len(ids), [int(v) for v in kv_lens]
        if n < 1 or len(positions) != n or len(slots) != n or len(kv) != n:
            raise ValueError(f"chain of {n} steps: {len(positions)} positions, {len(slots)} "
                             f"slots, {len(kv)} kv lengths")

        def chain() -> None:
            if prologue is not None:
                prologue()
            for i in range(n):
                logits = self._forward(ids[i:i + 1], positions[i:i + 1], slots[i:i + 1],
                                       kv[i], 1)                        # (1, V) f32
                epilogue(i, logits)

        self.backend.run_step((1, 1, "chain", n), (ids, positions, slots), chain)

    def _forward(self, ids, positions, slots, kv_len: int, n_logits: int, kv_positions=None,
                 attn_lo=None, attn_mask=None, taps=None, segments: Segmented | None = None):
        s, be, W = self.spec, self.backend, self.weights
        T = len(ids)
        mm = None if segments is None else segments.ranges     # the matmuls' runs
        runs = () if segments is None else segments.runs
        eps, neox = s.rms_eps, s.traits.rope_mode is RopeMode.NEOX
        x, h, o = self.ws_x[:T], self.ws_h[:T], self.ws_o[:T]
        K, V, hd, hv = self.k_dim, self.v_dim, s.head_dim, s.head_dim_v
        be.embed(W.embedding, ids, s.embed_scale, x)                    # (T, E)
        normed = False                    # h holds the norm the next matmul wants
        n = len(W.layers)
        taps = taps or {}
        for i, L in enumerate(W.layers):
            if i in taps:                 # the residual entering layer i
                be.copy_rows(*taps[i])
            lay = s.layers[i]
            H, Q, G = lay.n_head, lay.n_head * hd, lay.n_head * lay.attn_gate
            qkv = self._rows(self.ws_qkv, T, Q + K + V + G)             # (T, Q+K+V+G)
            attn = self._rows(self.ws_attn, T, H * hv)                  # (T, H*Dv)
            if not normed:
                be.rms_norm_for_matmul(x, L.attn_norm, eps, h)          # (T, E)
            self._matmuls(h, L.qkv, qkv, mm)                            # (T, Q+K+V+G)
            if L.qkv_bias is not None:
                be.add(qkv, L.qkv_bias, qkv)
            q = qkv[:, :Q].reshape(T, H, hd)                            # (T, H, hd)
            k = qkv[:, Q:Q + K].reshape(T, s.n_head_kv, hd)             # (T, Hkv, hd)
            v = qkv[:, Q + K:Q + K + V].reshape(T, s.n_head_kv, hv)     # (T, Hkv, hv)
            be.rope_kv(q, k, v, L.q_norm, L.k_norm, eps, positions, slots, self.rope_tables[i],
                       neox, self.cache, i, kv_positions)
            a = attn.reshape(T, H, hv)                                  # (T, H, hv)
            attend = be.attention if G else be.attention_for_matmul
            if segments is None:
                attend(q, self.cache, i, slots, positions, kv_len, lay.window, s.attn_scale,
                       a, attn_lo, attn_mask)
            for r0, r1, kv in runs:
                cut = slice(r0, r1)       # a segmented step: each run's rows as a step's
                attend(q[cut], self.cache, i, slots[cut], positions[cut], kv, lay.window,
                       s.attn_scale, a[cut], *(t if t is None else t[cut]
                                               for t in (attn_lo, attn_mask)))
            if G:
                g = qkv[:, Q + K + V:].reshape(T, H, lay.attn_gate)     # (T, H, 1 | hv)
                be.softplus_gate(a, g)
            if not self._residual(attn, L.wo, L.post_attn_norm, o, x, L.ffn_norm, h, mm):
                be.rms_norm_for_matmul(x, L.ffn_norm, eps, h)           # (T, E)
            if lay.moe:
                m = s.moe
                # a segmented step: each run's rows as a step's
                for hr, orow in ([(h, o)] if segments is None
                                 else [(h[a:b], o[a:b]) for a, b, _ in runs]):
                    be.moe(hr, L.router, L.gate_exps, L.up_exps, L.down_exps,
                           m.n_expert_used, m.normalize_top_k, s.traits.activation.value,
                           orow, gating=m.router.value, bias=L.router_bias,
                           scale=m.weights_scale)
                if L.shared_gate_up is not None:    # o += the shared expert's output
                    ff = m.n_ff_shared
                    gu, act = self._rows(self.ws_gu, T, 2 * ff), self._rows(self.ws_act, T, ff)
                    self._matmuls(h, L.shared_gate_up, gu, mm)          # (T, 2Fs)
                    be.glu_for_matmul(gu[:, :ff], gu[:, ff:], s.traits.activation.value, act)
                    be.matmul_add(act, L.shared_down, o, self.ws_o2[:T], mm)
                self._post(o, L.post_ffw_norm, x)
                normed = False
            else:
                ff = s.n_ff
                gu, act = self._rows(self.ws_gu, T, 2 * ff), self._rows(self.ws_act, T, ff)
                self._matmuls(h, L.gate_up, gu, mm)                     # (T, 2F)
                be.glu_for_matmul(gu[:, :ff], gu[:, ff:], s.traits.activation.value, act)
                # the next layer's input norm, or the output norm when every row has logits
                nxt = (W.layers[i + 1].attn_norm if i + 1 < n
                       else W.output_norm if n_logits == T and mm is None else None)
                normed = self._residual(act, L.down, L.post_ffw_norm, o, x, nxt, h, mm)
        if n in taps:                     # the final residual, before the output norm
            be.copy_rows(*taps[n])
        if n_logits == 0:
            return self.ws_logits[:0]
        xs, hs = x[T - n_logits:], h[:n_logits]
        if segments is not None:          # the named rows, gathered: o is free by now
            for j, r in enumerate(segments.logit_rows):
                be.copy_rows(x[r:r + 1], o[j:j + 1])
            xs = o[:n_logits]
        if not normed:                    # (normed here: the output norm, every row has logits)
            be.rms_norm_for_matmul(xs, W.output_norm, eps, hs)
        logits = self.ws_logits[:n_logits]
        be.matmul(hs, W.output, logits)                                 # (n, V)
        return logits

    def _residual(self, a, w, post_norm, o, x, norm=None, h=None, mm=None) -> bool:
        """x += post_norm(a @ W^T) (Gemma-3's post-norms) or x += a @ W^T; o (T, E) scratch.
        With `norm` (and no post-norm) also h = rms_norm(x) * norm, prepared for a matmul, in
        the same backend op; returns whether h was written. mm: the matmuls' runs."""
        eps = self.spec.rms_eps
        if post_norm is None and norm is not None:
            self.backend.matmul_add_norm(a, w, x, o, norm, eps, h, mm)  # (T, E), (T, E)
            return True
        if post_norm is None:
            self.backend.matmul_add(a, w, x, o, mm)                     # (T, E)
        else:
            self.backend.matmul(a, w, o, mm)                            # (T, E)
            self.backend.rms_norm_add(o, post_norm, eps, x)
        return False

    def _post(self, o, post_norm, x) -> None:
        """x += post_norm(o) or x += o."""
        if post_norm is None:
            self.backend.add(x, o, x)
        else:
            self.backend.rms_norm_add(o, post_norm, self.spec.rms_eps, x)


@dataclass(frozen=True)
class Segmented:
    """A step of several runs of rows (the runner's segmented steps: prompts' chunks, each
    padded alone, its padding rows first): runs[j] = (first row, end row, kv_len of the run)
    over the padded step, consecutive and covering it; logit_rows, the rows whose logits the
    step returns, in order (each run's last row at most). Every op of the step either treats
    rows alone (norms, RoPE, the KV write, GLU, adds) or runs per run: attention per run with
    the run's kv_len, the matmuls with the runs as segments (base.py) and the mixture of
    experts per run, so a run's rows, its KV rows and its logits row get the bits of a step of
    that run alone; the logits rows are gathered and go through the output norm and matmul as
    a mixed step's last rows do (the step-size-invariant path)."""

    runs: tuple[tuple[int, int, int], ...]
    logit_rows: tuple[int, ...]

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple((a, b) for a, b, _ in self.runs)

    def check(self, T: int, n_logits: int) -> None:
        segment_rows(self.ranges, T)
        ends = {b - 1 for _, b, _ in self.runs}
        if len(self.logit_rows) != n_logits or not set(self.logit_rows) <= ends \
                or list(self.logit_rows) != sorted(set(self.logit_rows)):
            raise ValueError(f"logits rows {list(self.logit_rows)} of a segmented step: "
                             f"{n_logits} runs' last rows, in order, wanted")


def positions_for(start: int, n: int) -> np.ndarray:
    """(n,) int32 positions start..start+n-1."""
    return np.arange(start, start + n, dtype=np.int32)
