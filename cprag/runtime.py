"""Where and in which precision the generator runs: the device, and the dtype that is fastest there.

CUDA runs bf16. On a CPU, bf16 matrix units (AMX-BF16 or AVX512-BF16) make batched passes (index encoding,
activation caches, batched decoding) faster; whether answers stay as good is measured (eval/dtype/), and
`CPU_BF16_DEFAULT` records the decision. `--dtype` overrides it everywhere.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from cprag.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# bf16 as the CPU default where the CPU has bf16 units: off until its EM on 300 validation questions is within a
# point of fp32's (eval/dtype/); `--dtype bfloat16` opts in
CPU_BF16_DEFAULT = False


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def cpu_has_bf16_units() -> bool:
    """Whether this CPU has bf16 matrix or vector units (AMX-BF16, AVX512-BF16), from /proc/cpuinfo."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("amx_bf16", "avx512_bf16"))


def resolve_dtype(device: str, dtype: str | None = None) -> torch.dtype:
    """`dtype` by name ("float32", "bfloat16"), or the default for `device`."""
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConfigError("--dtype", dtype, f"expected one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if CPU_BF16_DEFAULT and cpu_has_bf16_units() else torch.float32
