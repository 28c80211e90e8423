"""The few CUDA runtime calls that torch does not expose, through ctypes.

`cudaMemcpyBatchAsync` (CUDA 12.8+) queues many scattered copies on the copy engines in
one call; `cudaMemcpy2DAsync` queues one pitched copy (rows of one width at fixed
strides on both sides), which a copy engine runs as a single descriptor. Both reach the
runtime that torch itself loaded. `CopyEngines` is what the copiers use of them, which
tests replace with a stand-in (`testing/held_streams.py`). Imports torch only.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Protocol

import torch

_MIN_RUNTIME = 12080  # CUDA 12.8: first runtime with cudaMemcpyBatchAsync
# cudaMemcpyDefault: direction from the pointers (unified addressing)
_MEMCPY_DEFAULT = 4
_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_hint", MemLocation),
        ("dst_loc_hint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


class CopyEngines(Protocol):
    """The copy calls of `CudaRuntime` the copiers make; `stream` is a stream's
    `cuda_stream` handle."""

    @property
    def available(self) -> bool: ...

    @property
    def why_unavailable(self) -> str: ...

    def memcpy_batch(
        self,
        dsts: torch.Tensor,
        srcs: torch.Tensor,
        sizes: torch.Tensor,
        attrs: MemcpyAttributes,
        stream: int,
    ) -> None: ...

    def memcpy_2d(
        self,
        dst: int,
        dpitch: int,
        src: int,
        spitch: int,
        width: int,
        height: int,
        stream: int,
    ) -> None: ...

    def max_pitch(self, device: int) -> int: ...


class CudaRuntime:
    """Bindings to the CUDA runtime torch loaded; `available` is False where it lacks
    them."""

    def __init__(self) -> None:
        self.version = 0
        self.why_unavailable = ""
        self._lib = _load_cudart()
        if self._lib is None:
            self.why_unavailable = "no CUDA runtime library found"
            return
        version = ctypes.c_int(0)
        if self._lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
            self.why_unavailable = "cudaRuntimeGetVersion failed"
            return
        self.version = version.value
        if self.version < _MIN_RUNTIME or not hasattr(
            self._lib, "cudaMemcpyBatchAsync"
        ):
            self.why_unavailable = (
                f"CUDA runtime {self.version} has no cudaMemcpyBatchAsync"
            )
            return
        # CUDA 13 dropped the `failIdx` out-parameter that 12.8 and 12.9 have.
        self._has_fail_index = self.version < 13000

    @property
    def available(self) -> bool:
        return not self.why_unavailable

    def memcpy_batch(
        self,
        dsts: torch.Tensor,
        srcs: torch.Tensor,
        sizes: torch.Tensor,
        attrs: MemcpyAttributes,
        stream: int,
    ) -> None:
        """Queues `len(dsts)` copies on `stream`; the tensors are int64 on the host."""
        assert self._lib is not None and self.available
        count = dsts.numel()
        if count == 0:
            return
        attr_index = ctypes.c_size_t(0)
        args: list[object] = [
            ctypes.c_void_p(dsts.data_ptr()),
            ctypes.c_void_p(srcs.data_ptr()),
            ctypes.c_void_p(sizes.data_ptr()),
            ctypes.c_size_t(count),
            ctypes.byref(attrs),
            ctypes.byref(attr_index),
            ctypes.c_size_t(1),
        ]
        fail_index = ctypes.c_size_t(0)
        if self._has_fail_index:
            args.append(ctypes.byref(fail_index))
        args.append(ctypes.c_void_p(stream))
        code = self._lib.cudaMemcpyBatchAsync(*args)
        if code != 0:
            raise RuntimeError(
                f"cudaMemcpyBatchAsync of {count} copies returned error {code}"
            )

    def memcpy_2d(
        self,
        dst: int,
        dpitch: int,
        src: int,
        spitch: int,
        width: int,
        height: int,
        stream: int,
    ) -> None:
        """Queues `height` rows of `width` bytes, `spitch` apart at `src`, `dpitch` at
        `dst`."""
        assert self._lib is not None
        code = self._lib.cudaMemcpy2DAsync(
            ctypes.c_void_p(dst),
            ctypes.c_size_t(dpitch),
            ctypes.c_void_p(src),
            ctypes.c_size_t(spitch),
            ctypes.c_size_t(width),
            ctypes.c_size_t(height),
            ctypes.c_int(_MEMCPY_DEFAULT),
            ctypes.c_void_p(stream),
        )
        if code != 0:
            raise RuntimeError(f"cudaMemcpy2DAsync returned error {code}")

    def max_pitch(self, device: int) -> int:
        """The largest pitch a 2D copy may have on `device`, in bytes (0 if unknown)."""
        assert self._lib is not None
        value = ctypes.c_int(0)
        code = self._lib.cudaDeviceGetAttribute(
            ctypes.byref(value), ctypes.c_int(_ATTR_MAX_PITCH), ctypes.c_int(device)
        )
        return value.value if code == 0 else 0


def _load_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime torch was built with: by soname if loaded, else from its
    wheels."""
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libcudart.so.{major}"] if major else []
    names.append("libcudart.so")
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    root = os.path.dirname(os.path.dirname(torch.__file__))
    for path in sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcudart.so*"))):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


_RUNTIME: CudaRuntime | None = None


def cuda_runtime() -> CudaRuntime:
    """The process-wide bindings, loaded on first use."""
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = CudaRuntime()
    return _RUNTIME
