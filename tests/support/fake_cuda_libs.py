"""Fakes of the two other libraries the CUDA backend calls: cuda-bindings' driver module (for
kernels launched with programmatic dependent launch through `cuLaunchKernelEx`) and CuPy's
cuBLAS bindings (the prefill GEMM), over the same FakeDevice as the fake CuPy.

cuLaunchKernelEx receives kernel parameters as an array of addresses, one per parameter, the
way the driver does: the fake reads each value at its address with the width of the compiled
parameter's PTX type, as the driver would, so the parameter count cannot be seen here (the
driver cannot see it either); the CuPy path, which every captured step runs first, checks it.
A .u64 value must be null, a live device pointer, or sit where the CuPy path passed an integer.
"""

from __future__ import annotations

import ctypes
import enum
import importlib
import types
from typing import Any

from tests.support.fake_gpu import CaptureError, Gemm, KernelCheckError

# ---------------------------------------------------------------- cuda.bindings.driver


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_INVALID_HANDLE = 400


class CUlaunchAttributeID(enum.IntEnum):
    CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_EVENT = 7


class CUlaunchAttributeValue:
    __slots__ = ("programmaticStreamSerializationAllowed", "cooperative")

    def __init__(self) -> None:
        self.programmaticStreamSerializationAllowed = 0
        self.cooperative = 0


class CUlaunchAttribute:
    __slots__ = ("id", "value")

    def __init__(self) -> None:
        self.id = None
        self.value = CUlaunchAttributeValue()


class CUlaunchConfig:
    """Fixed attributes, as the Cython class has: a misspelled field raises AttributeError."""

    __slots__ = ("gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY", "blockDimZ",
                 "sharedMemBytes", "hStream", "attrs", "numAttrs")

    def __init__(self) -> None:
        for f in self.__slots__:
            setattr(self, f, 0)
        self.attrs = []


class _Handle:
    def __init__(self, init_value: Any = 0):
        self._ptr = int(init_value)

    def __int__(self) -> int:
        return self._ptr

    def getPtr(self) -> int:  # noqa: N802 - cuda-bindings' name
        return self._ptr


class CUstream(_Handle):
    pass


class CUfunction(_Handle):
    pass


_READ = {"u64": ctypes.c_uint64, "s64": ctypes.c_int64, "u32": ctypes.c_uint32,
         "s32": ctypes.c_int32, "f32": ctypes.c_float, "f64": ctypes.c_double,
         "u16": ctypes.c_uint16, "s16": ctypes.c_int16, "u8": ctypes.c_uint8,
         "s8": ctypes.c_int8}


def _launch_kernel_ex(cp, config: CUlaunchConfig, f: CUfunction, params: int,
                      extra: Any) -> tuple[CUresult]:
    fn = cp.functions.get(int(f))
    if fn is None:
        return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
    sig = fn.sig
    if extra not in (0, None) or not isinstance(params, int) or not params:
        raise KernelCheckError(f"cuLaunchKernelEx of {sig.name}: kernelParams must be the "
                               f"address of the parameter array, extra 0 ({params!r}, {extra!r})")
    attrs = list(config.attrs)
    if config.numAttrs != len(attrs):
        raise KernelCheckError(f"cuLaunchKernelEx of {sig.name}: numAttrs {config.numAttrs} "
                               f"for {len(attrs)} attributes")
    pdl = any(a.id == CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
              and a.value.programmaticStreamSerializationAllowed == 1 for a in attrs)
    slots = (ctypes.c_void_p * len(sig.params)).from_address(params)
    args = []
    for i, (p, at) in enumerate(zip(sig.params, slots, strict=True)):
        if not at or p not in _READ:
            raise KernelCheckError(f"cuLaunchKernelEx of {sig.name}: parameter {i} (.{p}) "
                                   "has no value address\n  compiled: " + sig.describe())
        args.append(cp.dev.driver_arg(sig, i, _READ[p].from_address(at).value))
    grid = (config.gridDimX, config.gridDimY, config.gridDimZ)
    block = (config.blockDimX, config.blockDimY, config.blockDimZ)
    cp.dev.launch(sig, grid, block, int(config.sharedMemBytes), fn.smem_optin, args,
                  int(config.hStream), "driver", pdl)
    return (CUresult.CUDA_SUCCESS,)


def driver_modules(cp) -> dict[str, types.ModuleType]:
    """The fake `cuda.bindings.driver` (and fake `cuda`, `cuda.bindings` packages when the
    real cuda-bindings is not installed)."""
    driver = types.ModuleType("cuda.bindings.driver", "fake cuda.bindings.driver")
    driver.__dict__.update(
        CUresult=CUresult, CUlaunchAttributeID=CUlaunchAttributeID,
        CUlaunchAttribute=CUlaunchAttribute, CUlaunchAttributeValue=CUlaunchAttributeValue,
        CUlaunchConfig=CUlaunchConfig, CUstream=CUstream, CUfunction=CUfunction,
        cuLaunchKernelEx=lambda config, f, params, extra: _launch_kernel_ex(
            cp, config, f, params, extra))
    out = {"cuda.bindings.driver": driver}
    try:
        importlib.import_module("cuda.bindings")
    except ImportError:
        out["cuda"] = types.ModuleType("cuda", "fake cuda package")
        out["cuda.bindings"] = types.ModuleType("cuda.bindings", "fake cuda.bindings package")
        out["cuda"].bindings = out["cuda.bindings"]
        out["cuda"].__path__ = out["cuda.bindings"].__path__ = []
    return out


# ---------------------------------------------------------------- cuBLAS
# cudaDataType_t element sizes (library_types.h): R_32F, R_64F, R_16F, R_8I, R_32I, R_16BF
_TYPE_BYTES = {0: 4, 1: 8, 2: 2, 3: 1, 10: 4, 14: 2}


class _Cublas:
    def __init__(self, cp):
        self.cp = cp
        self.handles: dict[int, dict[str, int]] = {}

    def create(self) -> int:
        h = 0xB1A5_0000 + len(self.handles) + 1
        self.handles[h] = {"stream": 0, "pointer_mode": 0}
        return h

    def _h(self, handle: int) -> dict[str, int]:
        if handle not in self.handles:
            raise KernelCheckError(f"cuBLAS handle {handle:#x} was not created")
        return self.handles[handle]

    def gemm_ex(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb,
                beta, C, Ctype, ldc, computeType, algo) -> None:
        """C (m, n) = alpha op(A) (m, k) op(B) (k, n) + beta C, column-major."""
        st, dev = self._h(handle), self.cp.dev
        what = f"cublasGemmEx(m={m}, n={n}, k={k})"
        for t in (Atype, Btype, Ctype):
            if t not in _TYPE_BYTES:
                raise KernelCheckError(f"{what}: unknown cudaDataType {t}")
        for ptr, t, ld, rows, cols, name in (
                (A, Atype, lda, m if transa == 0 else k, k if transa == 0 else m, "A"),
                (B, Btype, ldb, k if transb == 0 else n, n if transb == 0 else k, "B"),
                (C, Ctype, ldc, m, n, "C")):
            if ld < max(1, rows):
                raise KernelCheckError(f"{what}: ld{name.lower()} {ld} < {rows} rows")
            dev.check_range(int(ptr), ((cols - 1) * ld + rows) * _TYPE_BYTES[t],
                            f"{what} {name}")
        if st["pointer_mode"] == 0 and (dev.is_device(int(alpha)) or dev.is_device(int(beta))):
            raise KernelCheckError(f"{what}: host pointer mode with device alpha / beta")
        g = dev.capture_of(st["stream"], what)
        rec = Gemm(m, n, k, (transa, transb), (Atype, Btype, Ctype), st["stream"],
                   None if g is None else g.id)
        dev.gemms.append(rec)
        if g is not None:
            g.nodes.append(rec)

    def module(self) -> types.ModuleType:
        m = types.ModuleType("cupy_backends.cuda.libs.cublas", "fake cuBLAS bindings")

        def set_stream(h, s):
            if self.cp.dev.capturing:   # CuPy refuses cuBLAS calls while any stream captures
                raise CaptureError("calling cuBLAS API during stream capture is currently "
                                   "unsupported (CuPy's cublas.setStream)")
            self._h(h)["stream"] = int(s)

        def set_pointer_mode(h, mode):
            self._h(h)["pointer_mode"] = int(mode)

        m.__dict__.update(create=self.create, destroy=lambda h: self.handles.pop(h, None),
                          setStream=set_stream, getStream=lambda h: self._h(h)["stream"],
                          setPointerMode=set_pointer_mode,
                          getPointerMode=lambda h: self._h(h)["pointer_mode"],
                          gemmEx=self.gemm_ex)
        return m


def cublas_modules(cp) -> dict[str, types.ModuleType]:
    cublas = _Cublas(cp).module()
    libs = types.ModuleType("cupy_backends.cuda.libs", "fake")
    libs.cublas = cublas
    cuda = types.ModuleType("cupy_backends.cuda", "fake")
    cuda.libs = libs
    root = types.ModuleType("cupy_backends", "fake")
    root.cuda = cuda
    for p in (root, cuda, libs):
        p.__path__ = []
    return {"cupy_backends": root, "cupy_backends.cuda": cuda,
            "cupy_backends.cuda.libs": libs, "cupy_backends.cuda.libs.cublas": cublas}
