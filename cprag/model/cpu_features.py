"""What this CPU is and what its instruction set offers for bf16, read from /proc/cpuinfo (no torch import: the
training config resolves its dtype from it when it is built).

bf16 is fast only with bf16 units: AMX-BF16 or AVX512-BF16. Without them PyTorch emulates bf16 matmuls, and a
pass runs several times slower than in fp32 (here, an AMD EPYC with AVX2 only: the frozen blocks 0-23 at 114
tokens/s in bf16 autocast against 734 in fp32, 8 x 128 tokens).
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Set as AbstractSet
from pathlib import Path

BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first core's value of a /proc/cpuinfo field ("flags", "model name"); "" where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _flags() -> frozenset[str]:
    return frozenset(_cpuinfo("flags").split())


def cpu_has_bf16_units() -> bool:
    """Whether this CPU has bf16 matrix or vector units (AMX-BF16, AVX512-BF16), from /proc/cpuinfo."""
    return any(flag in _flags() for flag in BF16_FLAGS)


def fastest_cpu_dtype() -> str:
    """"bfloat16" where the CPU has bf16 units, else "float32": what batched passes (activation caches, training
    steps) should compute in on this machine."""
    return "bfloat16" if cpu_has_bf16_units() else "float32"


def fastest_dtype(device: str = "cpu") -> str:
    """What batched passes should compute in on `device`: bf16 on a GPU, else `fastest_cpu_dtype`."""
    return "bfloat16" if str(device).startswith("cuda") else fastest_cpu_dtype()


def cpu_units(flags: AbstractSet[str] | None = None) -> str:
    """The vector units that decide this CPU's speed here: "AMX-BF16", "AVX512-BF16", "AVX512", "AVX2" or "",
    the best one present (the CPU kinds this project runs on differ by exactly these)."""
    flags = _flags() if flags is None else flags
    for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"),
                       ("avx2", "AVX2")):
        if flag in flags:
            return name
    return ""


def cpu_name() -> str:
    """The CPU's model name and its best vector units ("AMD EPYC with AVX512-BF16"), for the figures a benchmark
    reports beside its speeds: the same model name covers kinds with and without bf16 units."""
    name = _cpuinfo("model name") or platform.processor() or "unknown CPU"
    units = cpu_units()
    return f"{name} with {units}" if units else name
