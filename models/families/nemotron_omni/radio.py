"""The RADIO vision tower of Nemotron-Omni on megatron-core transformer layers, with the pixel
shuffle and the vision-to-LM projector.

This module owns, for a packed batch of items (images, tiles, video tubelets):

* patch embedding: ``embeddings.patch_projection`` for image rows (C*P*P) and the separate
  ``embeddings.video_patch_projection`` for tubelet rows (T*C*P*P; frame 0 RGB then frame 1 RGB),
  both bias-free Linears; which one runs is decided by the row width, as HF does by channels;
* the absolute position table (side = max_img_size / patch), bilinearly interpolated
  (align_corners=False) to a max(h, w) square and cropped to (h, w), exactly as HF
  ``RadioPatchEmbeddings._interpolate_position_embedding``;
* ``num_cls_tokens + num_registers`` learned prefix tokens prepended to EVERY segment: a segment
  is one temporal slice of one item (a dynamic image, one 512x512 tile, one tubelet);
* the HF ``RadioLayer`` block as a megatron ``TransformerLayer`` (LayerNorm, q/k/v/proj biases,
  fc1-GELU-fc2 or SwiGLU MLP; local spec on CPU, TE on GPU) whose attention core is
  ``SegmentAttention`` (attention confined to each segment; no rotary). RADIO's LayerScale
  multiplies the attention and MLP outputs: it lives in the row-parallel output linears
  (``linear_proj.layer_scale``, ``mlp.linear_fc2.layer_scale``), scaling output and bias;
* the tower features without the prefix tokens, an optional final LayerNorm (HF
  ``vision_final_layernorm``, present when the LM has MTP layers), the pixel shuffle per segment
  (HF ``pixel_shuffle``: each merge x merge block -> one row, channel order (row, col) offsets),
  and the projector (RMSNorm, Linear, squared ReLU, Linear; no biases).

RADIO's input conditioner (mean/std) is NOT applied: the HF omni model detaches it
(``make_preprocessor_external``) and its image/video processors normalise the pixels.

``forward(pixel_values, grid_thw) -> (sum t*h*w/merge**2, lm_hidden)``: the merged tokens in item
order, slices in order, each slice row-major over its merged grid.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from models.families.nemotron_omni.config import NemotronOmniModelConfig, RadioConfig
from models.layers.recompute import run_layer, transformer_config_kwargs
from models.layers.vision_layers import tower_sharded_state_dict, vision_layer_spec


@functools.cache
def layer_scaled(base: type) -> type:
    """``base`` (a megatron row-parallel linear returning (out, bias)) with a LayerScale vector
    applied to its output and bias; the vector is replicated over TP (full hidden width)."""

    class LayerScaled(base):
        def __init__(self, input_size, output_size, *args, **kwargs):
            super().__init__(input_size, output_size, *args, **kwargs)
            self.layer_scale = nn.Parameter(torch.ones(output_size))

        def forward(self, *args, **kwargs):
            out, bias = super().forward(*args, **kwargs)
            scale = self.layer_scale.to(out.dtype)
            return out * scale, (bias * scale if bias is not None else None)

    LayerScaled.__name__ = LayerScaled.__qualname__ = f"LayerScaled{base.__name__}"
    return LayerScaled


def radio_layer_spec(use_te: bool):
    """The vision layer spec (LayerNorm, segment attention) with layer-scaled output linears."""
    spec = copy.deepcopy(vision_layer_spec("LayerNorm", use_te))
    attention = spec.submodules.self_attention.submodules
    attention.linear_proj = layer_scaled(attention.linear_proj)
    mlp = mlp_submodules(spec.submodules.mlp)
    mlp.linear_fc2 = layer_scaled(mlp.linear_fc2)
    return spec


def mlp_submodules(mlp_spec):
    """The MLPSubmodules of a layer spec's MLP: a ModuleSpec up to megatron-core 0.16, a
    ``functools.partial(MLP.as_mlp_submodule, submodules=...)`` from 0.17 on."""
    if isinstance(mlp_spec, functools.partial):
        return mlp_spec.keywords["submodules"]
    return mlp_spec.submodules


def radio_transformer_config(v: RadioConfig, recompute: str = "none") -> TransformerConfig:
    swiglu = v.mlp == "swiglu"
    return TransformerConfig(
        num_layers=v.depth, hidden_size=v.hidden_size, ffn_hidden_size=v.intermediate_size,
        num_attention_heads=v.num_heads, kv_channels=v.hidden_size // v.num_heads,
        normalization="LayerNorm", layernorm_epsilon=v.norm_eps, add_bias_linear=True,
        add_qkv_bias=v.qkv_bias, gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu, bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        **transformer_config_kwargs(recompute, block_recompute=False),  # full: run_layer
    )


# ------------------------------------------------------------------ geometry (no weights)
def segments(grid_thw: torch.Tensor) -> list[tuple[int, int]]:
    """(h, w) of every segment: every temporal slice of every item, in order."""
    return [(h, w) for t, h, w in grid_thw.tolist() for _ in range(t)]


def pixel_shuffle_index(segs: list[tuple[int, int]], merge: int) -> torch.Tensor:
    """Index into the (sum h*w) patch features giving, per segment, its merged tokens row-major,
    each as ``merge*merge`` consecutive patches in (row offset, column offset) order (HF
    ``pixel_shuffle`` channel layout)."""
    out, offset = [], 0
    for h, w in segs:
        rows = torch.arange(h).view(h // merge, 1, merge, 1)
        cols = torch.arange(w).view(1, w // merge, 1, merge)
        out.append((rows * w + cols).flatten() + offset)
        offset += h * w
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


class RadioEmbeddings(nn.Module):
    """Patch projections, position table, prefix (cls + register) tokens (HF names in comments)."""

    def __init__(self, v: RadioConfig):
        super().__init__()
        self.v = v
        patch = v.in_channels * v.patch_size ** 2
        self.patch_projection = nn.Linear(patch, v.hidden_size, bias=False)  # embedder
        self.video_patch_projection = nn.Linear(v.video_temporal_patch_size * patch,
                                                v.hidden_size, bias=False)  # video_embedder
        self.position_embedding = nn.Parameter(  # pos_embed
            torch.randn(1, v.position_side ** 2, v.hidden_size) * 0.02)
        self.cls_register_token = nn.Parameter(  # cls_token.token
            torch.randn(v.prefix_tokens, v.hidden_size) * 0.02)

    def position(self, h: int, w: int) -> torch.Tensor:
        """(h*w, hidden) position embeddings of an h x w grid (HF interpolation, row-major)."""
        side = self.v.position_side
        table = self.position_embedding.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        m = max(h, w)
        pos = F.interpolate(table.float(), size=(m, m), mode="bilinear", align_corners=False)
        return pos[0, :, :h, :w].flatten(1).t().to(self.position_embedding.dtype)

    def forward(self, pixel_values: torch.Tensor, segs: list[tuple[int, int]]) -> torch.Tensor:
        """(sum h*w, D) patch rows -> (sum prefix + h*w, hidden) packed segment sequences."""
        video = pixel_values.shape[1] != self.patch_projection.in_features
        proj = self.video_patch_projection if video else self.patch_projection
        if pixel_values.shape[1] != proj.in_features:
            raise ValueError(f"pixel rows of width {pixel_values.shape[1]}: expected "
                             f"{self.patch_projection.in_features} (image) or "
                             f"{self.video_patch_projection.in_features} (video tubelet)")
        x = proj(pixel_values.to(proj.weight.dtype))
        positions: dict[tuple[int, int], torch.Tensor] = {}
        pieces, offset = [], 0
        for h, w in segs:
            if (h, w) not in positions:
                positions[(h, w)] = self.position(h, w)
            pieces += [self.cls_register_token.to(x.dtype),
                       x[offset:offset + h * w] + positions[(h, w)].to(x.dtype)]
            offset += h * w
        return torch.cat(pieces) if pieces else x


class RMSNormFP32(nn.Module):
    """RMSNorm computed in fp32, weight applied in fp32 (HF ``NemotronH_Omni_RMSNorm``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


class Projector(nn.Module):
    """HF ``MultiModalProjector``: RMSNorm(eps 1e-5), Linear, squared ReLU, Linear; no biases."""

    def __init__(self, width: int, hidden: int, out: int):
        super().__init__()
        self.layer_norm = RMSNormFP32(width, eps=1e-5)
        self.linear_1 = nn.Linear(width, hidden, bias=False)
        self.linear_2 = nn.Linear(hidden, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(torch.relu(self.linear_1(self.layer_norm(x))).pow(2))


class RadioEncoder(MegatronModule):
    """RADIO tower + pixel shuffle + projector (see module docstring)."""

    def __init__(self, cfg: NemotronOmniModelConfig, *, use_te: bool):
        v = cfg.vision
        tconfig = radio_transformer_config(v, cfg.recompute)
        self.recompute = cfg.recompute
        super().__init__(config=tconfig)
        self.v, self.merge = v, cfg.merge_size
        self.embeddings = RadioEmbeddings(v)
        spec = radio_layer_spec(use_te)
        self.layers = nn.ModuleList(build_module(spec, config=tconfig, layer_number=i + 1)
                                    for i in range(v.depth))
        with torch.no_grad():
            for p in self.layer_scales():
                p.fill_(v.layerscale_value)
        self.final_norm = (nn.LayerNorm(v.hidden_size, eps=v.norm_eps)
                           if cfg.vision_final_norm else None)
        self.projector = Projector(v.hidden_size * self.merge ** 2, cfg.projector_hidden_size,
                                   cfg.lm.hidden_size)

    def layer_scales(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if n.endswith("layer_scale")]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return tower_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """(sum t*h*w, D) patch rows + (n, 3) grids -> (sum t*h*w / merge**2, LM hidden)."""
        segs = segments(grid_thw.cpu().long())
        prefix = self.v.prefix_tokens
        hidden = self.embeddings(pixel_values, segs)
        lengths = torch.tensor([prefix + h * w for h, w in segs], dtype=torch.int32)
        bounds = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)).to(hidden.device)
        params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds)
        hidden = hidden[:, None, :]  # megatron layout (s, b=1, h)
        for layer in self.layers:
            hidden = run_layer(layer, hidden, self.recompute, attention_mask=None,
                               packed_seq_params=params)
        keep = torch.ones(hidden.shape[0], dtype=torch.bool)
        for start in bounds[:-1].tolist():
            keep[start:start + prefix] = False
        features = hidden[:, 0][keep.to(hidden.device)]
        if self.final_norm is not None:
            features = self.final_norm(features)
        order = pixel_shuffle_index(segs, self.merge).to(features.device)
        merged = features[order].reshape(-1, features.shape[-1] * self.merge ** 2)
        return self.projector(merged)
