"""Low-rank adapters on backbone linear layers: W x + (alpha / r) B A x, with W frozen and A, B trained.

The adapters live beside the backbone (a ModuleDict on the CPLM), attached to its linear layers by forward hooks,
so the backbone keeps its parameter names: a checkpoint stores the adapters as it stores the CP head, and every
base weight still comes from the referenced GGUF. `merge` folds B A into the base weights for inference (no extra
matmuls per decode step); the adapter tensors stay, so checkpoints and fingerprints are unchanged by it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LowRankDelta(nn.Module):
    """The trained part of one adapted linear layer: delta(x) = scale · B A x."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float):
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = alpha / rank
        self.merged = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # B = 0: an adapter starts as the identity edit, so training starts from the pretrained backbone
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        down = x @ self.lora_A.to(x.dtype).T  # (..., r)
        return (down @ self.lora_B.to(x.dtype).T) * self.scale

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B @ self.lora_A) * self.scale  # (out, in)


def adapter_name(layer: int, module: str) -> str:
    return f"layer{layer}_{module}"


def _target(backbone: nn.Module, layer: int, module: str) -> nn.Linear:
    block = backbone.layers[layer]
    parent = block.self_attn if module in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp
    return getattr(parent, module)


def build_adapters(backbone: nn.Module, layers: list[int], modules: list[str], rank: int,
                   alpha: float) -> nn.ModuleDict:
    """One LowRankDelta per (layer, module), hooked onto the backbone's linear layers."""
    adapters = nn.ModuleDict()
    for layer in layers:
        for module in modules:
            linear = _target(backbone, layer, module)
            delta = LowRankDelta(linear.in_features, linear.out_features, rank, alpha)
            adapters[adapter_name(layer, module)] = delta
            linear.register_forward_hook(_hook(delta))
    return adapters


def _hook(delta: LowRankDelta):
    def add_delta(_module, inputs, output):
        return output if delta.merged else output + delta(inputs[0])

    return add_delta


@torch.no_grad()
def merge(backbone: nn.Module, adapters: nn.ModuleDict) -> None:
    """Fold every adapter into its base weight (inference only: the base weights then hold W + B A)."""
    for name, delta in adapters.items():
        if delta.merged:
            continue
        layer, module = name[len("layer"):].split("_", 1)
        linear = _target(backbone, int(layer), module)
        linear.weight += delta.delta_weight().to(linear.weight.dtype)
        delta.merged = True
