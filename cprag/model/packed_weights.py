"""oneDNN-packed linear layers and decoder layers: a bf16 backbone's passes about 1.3 times as fast on a CPU.

`nn.Linear` hands oneDNN its weight in PyTorch's plain layout, and a bf16 matmul then re-blocks the weight on
every call. At decoding's few rows per pass that re-blocking is most of the cost: a hidden -> MLP projection took
about 150 us per call at 1 to 16 rows against about 75 us with the weight packed once, ahead of time, into
oneDNN's own layout (`eval/cpu-latency.md`). The outputs are bit for bit those of `nn.Linear` (same kernel, same
blocking); only the copy of the weight moves. This is what torch.compile's CPU freezing pass does, without its
compile time or its shape guards.

`pack_decoder_layers` goes one step further for Llama blocks: one packed matmul for q, k and v, one for the gate
and up projections, and the block's forward without transformers' per-module wrappers. A one-token pass of the
30-block backbone took 25.6 ms with packed `nn.Linear`s and 21 ms so (`eval/cpu-latency.md`). The hidden states
are bit for bit transformers' at decoding's sizes (a few rows of up to tens of tokens); a batch's prompt pass of
hundreds of rows can differ in the last bf16 bit, as any change of batch shape can.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
from torch import nn


def packing_supported(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether `pack_linears` and `pack_decoder_layers` apply: bf16 on a CPU whose oneDNN has a bf16 path.

    oneDNN's bf16 kernels need AVX512 (BW, VL, DQ) or AVX-NE-CONVERT; on a CPU without them (an AMD EPYC with
    AVX2 only, say) reordering a weight raises, so a bf16 model there runs on plain `nn.Linear`s instead."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and onednn_has_bf16())


@functools.cache
def onednn_has_bf16() -> bool:
    """Whether this CPU runs oneDNN's bf16 kernels (PyTorch's own check, which its CPU compiler also asks)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def _packed(weights: list[torch.Tensor]) -> torch.Tensor:
    """The rows of `weights` stacked, in oneDNN's blocked layout (a hint of None: blocked for any number of input
    rows; decoding feeds 1 to a few hundred)."""
    return torch.ops.mkldnn._reorder_linear_weight(torch.cat([w.detach() for w in weights]), None)


def _apply(inputs: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(inputs, packed, bias, "none", [None], "")


class PackedLinear(nn.Module):
    """An inference-only `nn.Linear` whose weight is also held in oneDNN's blocked layout.

    `weight` and `bias` stay as they were (state dicts, fingerprints and `.to` see an ordinary layer); `forward`
    reads the packed copy, except where autograd or another dtype needs the plain one. Built from a bf16 CPU
    `nn.Linear` by `pack_linears`, or from a bare weight (the LM head tied to the input embeddings).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # a layer's parameters stay registered under their old names (state dicts, `.to`, `parameters()`); a
        # plain tensor (the tied LM head's rows) stays an attribute, so nothing is listed twice
        self.weight, self.bias = weight, bias
        self.packed = _packed([weight])

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if inputs.dtype != torch.bfloat16 or inputs.device.type != "cpu" or torch.is_grad_enabled():
            return nn.functional.linear(inputs, self.weight, self.bias)
        return _apply(inputs, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(module: nn.Module) -> int:
    """Replace every bf16 CPU `nn.Linear` under `module` by a `PackedLinear`; returns how many were packed."""
    packed = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.dtype == torch.bfloat16
                    and child.weight.device.type == "cpu"):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                packed += 1
    return packed


@dataclass
class PackedBlockWeights:
    """A Llama block's projections, fused and packed: [q; k; v], o, [gate; up], down."""

    qkv: torch.Tensor
    qkv_sizes: tuple[int, int, int]
    o: torch.Tensor
    gate_up: torch.Tensor
    intermediate: int
    down: torch.Tensor


def _is_plain_llama_block(layer: nn.Module) -> bool:
    """A transformers Llama block with bias-free projections, SiLU gating and sdpa attention, in bf16 on a CPU."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = [(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"),
             (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj")]
    linears = [getattr(owner, name, None) for owner, name in names]
    return (all(isinstance(x, nn.Linear) and x.bias is None and x.weight.dtype == torch.bfloat16
                and x.weight.device.type == "cpu" for x in linears)
            and (isinstance(mlp.act_fn, nn.SiLU) or type(mlp.act_fn).__name__ == "SiLUActivation")
            and getattr(attn.config, "_attn_implementation", None) == "sdpa"
            and all(hasattr(layer, name) for name in ("input_layernorm", "post_attention_layernorm")))


def _rms_norm(hidden: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' LlamaRMSNorm in one fused op: normalised in fp32, rounded back, then scaled (bit for bit)."""
    scaled = nn.functional.rms_norm(hidden.to(torch.float32), norm.weight.shape, eps=norm.variance_epsilon)
    return norm.weight * scaled.to(hidden.dtype)


def _packed_block_forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                          position_ids: torch.Tensor | None = None, cache=None, use_cache: bool = False,
                          position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs):
    """transformers' LlamaDecoderLayer.forward on the fused packed weights, with fewer ops: rotary turns the query
    and key heads in one go, and attention reads the shared key/value heads in place (`enable_gqa`) rather than
    repeated. Every op is elementwise the same as transformers', so the outputs are too. (B, T, H) -> (B, T, H)."""
    if torch.is_grad_enabled() or hidden_states.dtype != torch.bfloat16 or hidden_states.device.type != "cpu":
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, use_cache=use_cache, position_embeddings=position_embeddings,
                                  **kwargs)
    weights, attn = self.packed_weights, self.self_attn
    batch, length = hidden_states.shape[:2]
    dim = attn.head_dim
    heads, kv_heads = weights.qkv_sizes[0] // dim, weights.qkv_sizes[1] // dim
    qkv = _apply(_rms_norm(hidden_states, self.input_layernorm), weights.qkv)
    qkv = qkv.view(batch, length, heads + 2 * kv_heads, dim)  # (B, T, q heads + k heads + v heads, d)
    cos, sin = (x.unsqueeze(2) for x in position_embeddings)  # (B, T, 1, d)
    turned = qkv[:, :, : heads + kv_heads]  # q and k heads
    half = dim // 2
    turned = turned * cos + torch.cat((-turned[..., half:], turned[..., :half]), dim=-1) * sin
    q = turned[:, :, :heads].transpose(1, 2)  # (B, heads, T, d)
    k, v = turned[:, :, heads:].transpose(1, 2), qkv[:, :, heads + kv_heads :].transpose(1, 2)  # (B, kv, T, d)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx)
    causal = length > 1 and attention_mask is None  # as transformers' sdpa_attention_forward decides
    if causal and k.shape[2] > length:
        k, v = k[:, :, :length], v[:, :, :length]
    out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=attn.scaling,
                                                     is_causal=causal, enable_gqa=True)  # (B, heads, T, d)
    hidden = hidden_states + _apply(out.transpose(1, 2).reshape(batch, length, -1), weights.o)
    gate_up = _apply(_rms_norm(hidden, self.post_attention_layernorm), weights.gate_up)
    gate, up = gate_up[..., : weights.intermediate], gate_up[..., weights.intermediate :]
    return hidden + _apply(nn.functional.silu(gate) * up, weights.down)


def pack_decoder_layers(backbone: nn.Module) -> int:
    """Give every plain Llama block of `backbone` a forward over fused packed weights (inference only: with
    autograd on, or another dtype or device, the block runs transformers' own forward); any other block gets
    `pack_linears`. Returns how many blocks were fused. The projections stay as they were (state dicts and
    fingerprints see the same layers)."""
    fused = 0
    for layer in getattr(backbone, "layers", []):
        if not _is_plain_llama_block(layer):
            pack_linears(layer)
            continue
        attn, mlp = layer.self_attn, layer.mlp
        layer.packed_weights = PackedBlockWeights(
            qkv=_packed([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
            qkv_sizes=(attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features),
            o=_packed([attn.o_proj.weight]), gate_up=_packed([mlp.gate_proj.weight, mlp.up_proj.weight]),
            intermediate=mlp.gate_proj.out_features, down=_packed([mlp.down_proj.weight]))
        layer.forward = types.MethodType(_packed_block_forward, layer)
        fused += 1
    return fused
