"""Where and in which precision the generator runs: the device, and the dtype that is fastest there.

CUDA runs bf16. On a CPU, bf16 matrix units (AMX-BF16 or AVX512-BF16) make passes faster; whether answers stay
as good is measured (`eval/scripts/dtype_qa.py`, `eval/dtype/qa.json`), and `CPU_BF16_DEFAULT` records the decision.
`--dtype` (or the `CPRAG_DTYPE` environment variable) overrides it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

from cprag.errors import ConfigError
from cprag.model.backbone import output_weight
from cprag.model.cpu_features import cpu_has_bf16_units
from cprag.model.packed_weights import PackedLinear, pack_decoder_layers, packing_supported

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# bf16 as the CPU default where the CPU has bf16 units. The rule: only if hidden EM on 300 validation questions
# moves by at most 1 point. Measured in one run (eval/dtype/qa.json, Intel Xeon with AMX-BF16, fused packed blocks and
# an fp32 head, the 12-block checkpoint): EM 47.0 fp32 against 46.33 bf16, F1 55.25 vs 54.59, 2 of 300 answers
# changed; key encoding 3.25x faster, ask p50 0.52x
CPU_BF16_DEFAULT = True


def place(model, device: str, dtype: torch.dtype):
    """The generator on `device` for inference: the backbone in `dtype` (in bf16 on a CPU, its blocks run on fused
    weights packed for oneDNN, `cprag.model.packed_weights`), the CP head and the `<copy>` gate in fp32.

    Copy scores are logits in the tens; bf16 keeps 8 bits, so rounding one moved a copy probability by 10 to 25%,
    and which way depended on the batch a question shared (oneDNN picks kernels by shape): batched answers then
    differed from one-at-a-time ones. The head is a few small matmuls per step, so fp32 costs little there.
    """
    model = model.to(device, dtype)
    if torch.device(device).type == "cpu":
        reuse_freed_memory()
    model.cp_head.float()
    model.copy_gate.float()
    if packing_supported(device, dtype):  # the same outputs, faster (cprag.model.packed_weights)
        pack_decoder_layers(model.backbone)
        model.packed_lm_head = PackedLinear(output_weight(model.backbone).detach())
    return model


# glibc's mallopt parameters (malloc.h) and the values set
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES, _TRIM_THRESHOLD_BYTES = 256 << 20, 1 << 30


def reuse_freed_memory() -> bool:
    """Let glibc's malloc keep freed blocks of up to 256 MiB for reuse instead of unmapping them.

    A pass allocates a few (rows, positions, vocabulary) tensors of tens of MB; glibc serves blocks that large
    with fresh mappings, so every pass paid the kernel to zero and fault in those pages again. Reused, 16
    questions per batch ran about 6% faster here (eval/cpu-latency.md); the cost is that the process keeps up to
    1 GiB of freed heap mapped. Returns whether the C library took the settings (False off glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
                    and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))
    except (OSError, AttributeError, TypeError):
        return False


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(device: str, dtype: str | None = None) -> torch.dtype:
    """`dtype` by name ("float32", "bfloat16"), else `CPRAG_DTYPE`, else the default for `device`."""
    dtype = dtype if dtype is not None else os.environ.get("CPRAG_DTYPE") or None
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConfigError("--dtype", dtype, f"expected one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if CPU_BF16_DEFAULT and cpu_has_bf16_units() else torch.float32
