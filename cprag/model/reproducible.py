"""Whether the BLAS under torch gives the same bits whatever the thread count: the guarantee that an index is a
pure function of its corpus, model and flags, on one machine.

oneMKL (torch's CPU BLAS on x86) splits some matrix products across threads in ways that change the order of
their sums, so one thread and two threads gave different keys (eval/reproducible/). Its strict conditional
numerical reproducibility mode (`MKL_CBWR=AUTO,STRICT`, set by `import cprag` before torch loads) removes that. It
can only be switched on before MKL's first call, so a program that ran a matrix product before importing cprag
keeps MKL's default: `blas_reproducible()` says which, and `cprag index` records it in the manifest.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

_AUTO, _STRICT, _ALL = 0x2, 0x10000, -1


@functools.cache
def _mkl():
    """oneMKL's service calls inside torch's CPU library, or None (another BLAS, or not exported)."""
    import torch

    try:
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get, put = library.mkl_serv_cbwr_get, library.mkl_serv_cbwr_set
    except (OSError, AttributeError):
        return None
    get.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
    put.argtypes, put.restype = [ctypes.c_int], ctypes.c_int
    return get, put


def blas_reproducible() -> bool | None:
    """True when MKL runs in strict reproducible mode, False when it does not (switching it on now, if MKL has not
    run yet), None when torch's BLAS is not MKL (then nothing here is known about it)."""
    calls = _mkl()
    if calls is None:
        return None
    get, put = calls
    if get(_ALL) & _STRICT:
        return True
    return put(_AUTO | _STRICT) == 0  # fails once MKL has run: its mode is fixed for the process
