"""Element formats named across layers: the KV-cache element types, defined once.

A leaf module (it imports nothing of the service), so `service.config` can validate a
configuration without importing a backend, and both backends declare what their kernels do
from the same names. Weight formats are `service.gguf.quants.QuantType`, the GGUF type ids.
"""

from __future__ import annotations

import enum


class KVType(enum.StrEnum):
    """A KV-cache element type (K and V are chosen independently). The value is the name users
    write (`--kv-cache-type-k q8_0`); a KVType compares equal to its name."""

    F16 = "f16"
    BF16 = "bf16"
    Q8_0 = "q8_0"
    Q5_1 = "q5_1"
    Q5_0 = "q5_0"
    Q4_1 = "q4_1"
    Q4_0 = "q4_0"


KV_TYPES: tuple[KVType, ...] = tuple(KVType)   # every type a configuration may name

# The types each backend's kernels implement, for K and V independently (each backend class's
# `kv_types` is its entry; tests check it). Startup validation and the ValidateConfig RPC take
# the supported pairs from here, without importing a backend.
BACKEND_KV_TYPES: dict[str, tuple[KVType, ...]] = {
    "cpu": KV_TYPES,
    "cuda": KV_TYPES,
}


def supported_kv_pairs(backend: str = "auto") -> tuple[tuple[KVType, KVType], ...]:
    """(K, V) pairs the named backend supports; 'auto' (or an unknown name): the pairs every
    backend supports, since either may be picked."""
    kinds = ([BACKEND_KV_TYPES[backend]] if backend in BACKEND_KV_TYPES
             else list(BACKEND_KV_TYPES.values()))
    common = [t for t in kinds[0] if all(t in k for k in kinds)]
    return tuple((k, v) for k in common for v in common)
