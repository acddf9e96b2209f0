"""ctypes access to the parts of llama.cpp's C API that drafters reading a target's hidden
states need, for the oracle scripts (bench/llamacpp_*_oracle.py) that run under an interpreter
with llama-cpp-python 0.3.36 built from source. Imports nothing from this project; the project
never imports it.

llama_cpp's module binds include/llama.h (the extended batch API `llama_batch_ext_*`,
`llama_process` with LLAMA_PROCESS_TYPE_ENCODE/DECODE, `llama_context_params.ctx_other`), not
src/llama-ext.h, whose functions are bound here from the same shared library (by their C++
names: llama-ext.h declares them without extern "C"; `_mangled` writes the Itanium ABI name):

    llama_set_embeddings_layer_inp(ctx, lid, on)   keep the residual entering layer lid of
    llama_get_embeddings_layer_inp(ctx, lid)       every token of a batch: (n_tokens, n_embd)
    llama_set_embeddings_nextn(ctx, on, masked)    keep t_h_nextn (a drafter's pre-norm output;
    llama_get_embeddings_nextn(_ith)(ctx[, i])     masked: only for rows with output set)
    llama_model_target_layer_ids(_n)(model)        a drafter's target layers

`Runtime` wraps a model and context pair the way common/speculative.cpp uses them: a batch of
entries (token id and/or embedding row, position, output flag) processed as one ubatch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
from llama_cpp import llama_cpp as ll

_F = ctypes.POINTER(ctypes.c_float)


# argument kind -> (ctypes type, Itanium ABI code)
_CTX = (ll.llama_context_p_ctypes, "P13llama_context")
_MODEL = (ll.llama_model_p_ctypes, "PK11llama_model")        # const llama_model *
_U32, _I32, _BOOL = (ctypes.c_uint32, "j"), (ctypes.c_int32, "i"), (ctypes.c_bool, "b")


def _mangled(name: str, args: list[tuple]) -> str:
    return f"_Z{len(name)}{name}" + "".join(code for _, code in args)


def _bind(name: str, args: list[tuple], res):
    fn = getattr(ll._lib, _mangled(name, args))
    fn.argtypes, fn.restype = [t for t, _ in args], res
    return fn


set_embeddings_layer_inp = _bind("llama_set_embeddings_layer_inp", [_CTX, _U32, _BOOL], None)
get_embeddings_layer_inp = _bind("llama_get_embeddings_layer_inp", [_CTX, _U32], _F)
set_embeddings_nextn = _bind("llama_set_embeddings_nextn", [_CTX, _BOOL, _BOOL], None)
get_embeddings_nextn = _bind("llama_get_embeddings_nextn", [_CTX], _F)
get_embeddings_nextn_ith = _bind("llama_get_embeddings_nextn_ith", [_CTX, _I32], _F)
_target_layer_ids = _bind("llama_model_target_layer_ids", [_MODEL],
                          ctypes.POINTER(ctypes.c_int32))
_target_layer_ids_n = _bind("llama_model_target_layer_ids_n", [_MODEL], ctypes.c_uint32)

ENCODE, DECODE = ll.LLAMA_PROCESS_TYPE_ENCODE, ll.LLAMA_PROCESS_TYPE_DECODE


def rows(ptr, n: int, width: int) -> np.ndarray:
    """Copy n rows of width floats from a llama.cpp buffer: (n, width) f32."""
    if not ptr:
        raise RuntimeError("llama.cpp returned no rows (extraction not enabled?)")
    return np.ctypeslib.as_array(ptr, shape=(n * width,)).reshape(n, width).copy()


def target_layer_ids(model) -> list[int]:
    n = _target_layer_ids_n(model)
    p = _target_layer_ids(model)
    return [int(p[i]) for i in range(n)]


@dataclass
class Entry:
    token: int | None                # None: an embedding-only entry
    pos: int
    output: bool
    embd: np.ndarray | None = None   # (width,) f32, kept alive until processed


@dataclass
class Runtime:
    """One llama.cpp model and context (n_threads threads, f16 KV, one sequence)."""
    path: str
    n_ctx: int = 128
    n_threads: int = 2
    other: Runtime | None = None     # the target, for a drafter that borrows its tensors
    flash_attn: int | None = None    # llama_context_params.flash_attn_type (None: the default,
                                     # auto; the CPU kernel accumulates V rows in f16)
    model: object = field(init=False)
    ctx: object = field(init=False)

    def __post_init__(self):
        ll.llama_backend_init()
        mp = ll.llama_model_default_params()
        self.model = ll.llama_model_load_from_file(self.path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {self.path}")
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = self.n_ctx, self.n_ctx, self.n_ctx
        cp.n_threads = cp.n_threads_batch = self.n_threads
        if self.other is not None:
            cp.ctx_other = self.other.ctx
        if self.flash_attn is not None:
            cp.flash_attn_type = self.flash_attn
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {self.path}")
        self.batch = ll.llama_batch_ext_init(self.ctx)

    @property
    def n_embd(self) -> int:
        return ll.llama_model_n_embd(self.model)

    @property
    def n_vocab(self) -> int:
        return ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))

    def process(self, kind: int, entries: list[Entry]) -> None:
        """One ubatch of entries, in order; raises on llama.cpp's error codes."""
        b = self.batch
        ll.llama_batch_ext_clear(b)
        for e in entries:
            view = None
            if e.embd is not None:
                e.embd = np.ascontiguousarray(e.embd, np.float32)
                view = ll.llama_embd(e.embd.ctypes.data_as(_F), 1, e.embd.shape[-1])
            if e.token is None:
                idx = ll.llama_batch_ext_add_embd(b, 0, view)
            else:
                idx = ll.llama_batch_ext_add_token(b, 0, e.token)
            if idx < 0:
                raise RuntimeError(f"llama_batch_ext_add: {idx}")
            pos = (ll.llama_pos * 1)(e.pos)
            ll.llama_batch_ext_set_pos(b, idx, pos)
            if e.token is not None and view is not None \
                    and not ll.llama_batch_ext_set_embd_token(b, idx, view):
                raise RuntimeError("llama_batch_ext_set_embd_token failed")
            if e.output:
                ll.llama_batch_ext_set_output_logits(b, idx, True)
        rc = ll.llama_process(self.ctx, kind, b)
        if rc != 0:
            raise RuntimeError(f"llama_process: {rc}")

    def logits(self, i: int) -> np.ndarray:
        """The logits of output row i (batch index): (V,) f32."""
        return rows(ll.llama_get_logits_ith(self.ctx, i), 1, self.n_vocab)[0]

    def drop_from(self, pos: int) -> None:
        """Forget the KV rows at positions >= pos."""
        ll.llama_memory_seq_rm(ll.llama_get_memory(self.ctx), 0, pos, -1)
