"""The Qwen ViT (Qwen2.5-VL, Qwen3-VL, Qwen3.5) on megatron-core transformer layers, shared by
the families that use it (``models/families/qwen_vl``, ``models/families/qwen3_5``).

This module owns the vision tower: patch embedding (the Conv3d over a temporal patch of 2 with
stride = kernel, written as the equivalent Linear over a flattened patch row), the 2D rotary
embedding (h and w frequencies, patches in 2x2 merge-block order), the megatron
``TransformerLayer`` stack (local spec on CPU, TransformerEngine linears/norms on GPU, attention
core ``SegmentAttention``: block-diagonal over each image / temporal slice, or each window), and the
2x2 patch mergers to the LM width.

Qwen2.5-VL: RMSNorm, gated SiLU MLP with biases, window attention (windows of ``window_size``
pixels over the merged grid; patches are permuted so windows are contiguous and un-permuted after
the merger), full attention in ``fullatt_block_indexes``.
Qwen3-VL: LayerNorm, GELU(tanh) MLP with biases, learned position embeddings bilinearly
interpolated (align_corners) from a square table, full attention per temporal slice everywhere,
DeepStack mergers on the outputs of ``deepstack_visual_indexes`` blocks.
Qwen3.5: Qwen3-VL's tower without DeepStack (no ``deepstack_visual_indexes``).

The model config it takes (``cfg``) has ``vision``
(``models.layers.qwen_vision_config.VisionConfig``), ``variant`` (``vision_norm``, ``gated_mlp``,
``windowed``, ``learned_positions``), ``family`` and ``recompute``.

``forward(pixel_values, grid_thw) -> (embeds, deepstack)``: embeds (sum t*h*w/4, out_hidden),
deepstack a list (one per DeepStack index, empty for Qwen2.5-VL) of tensors of the same shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from models.layers.qwen_vision_config import VisionConfig
from models.layers.recompute import run_layer, transformer_config_kwargs
from models.layers.vision_layers import ACTIVATIONS, tower_sharded_state_dict, vision_layer_spec


def vision_transformer_config(v: VisionConfig, variant, recompute: str = "none"
                              ) -> TransformerConfig:
    return TransformerConfig(
        num_layers=v.depth, hidden_size=v.hidden_size, ffn_hidden_size=v.intermediate_size,
        num_attention_heads=v.num_heads, kv_channels=v.hidden_size // v.num_heads,
        normalization=variant.vision_norm, layernorm_epsilon=v.norm_eps,
        add_bias_linear=True, add_qkv_bias=True, gated_linear_unit=variant.gated_mlp,
        activation_func=ACTIVATIONS[v.hidden_act], bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        **transformer_config_kwargs(recompute, block_recompute=False),  # full: run_layer
    )


class PatchMerger(nn.Module):
    """2x2 merge: norm, view 4 patches as one row, Linear-GELU-Linear to the LM width.

    ``norm_after_merge`` (Qwen3-VL DeepStack) normalises the merged 4*width row instead.
    """

    def __init__(self, width: int, out: int, merge: int, rms: bool, norm_after_merge=False):
        super().__init__()
        self.merged = width * merge * merge
        self.norm_after_merge = norm_after_merge
        size = self.merged if norm_after_merge else width
        self.norm = nn.RMSNorm(size, eps=1e-6) if rms else nn.LayerNorm(size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged) if self.norm_after_merge else x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.view(-1, self.merged))))


# ------------------------------------------------------------------ geometry (no weights)
def segment_bounds(grid_thw: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (int32) of every temporal slice of every image/video (patch units)."""
    sizes = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(sizes.cumsum(0, dtype=torch.int32), (1, 0))


def rotary_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(N, 2) (row, col) of every patch, patches in 2x2 merge-block order, repeated per slice."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        blocks = [x.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()
                  for x in (rows, cols)]
        out.append(torch.stack(blocks, dim=-1).repeat(t, 1))
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.long)


def window_layout(grid_thw: torch.Tensor, merge: int, window_size: int, patch_size: int):
    """Qwen2.5-VL windows: (merged-token permutation, cu_window_seqlens in patch units)."""
    side = window_size // merge // patch_size
    unit = merge * merge
    index, bounds, offset = [], [0], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        ids = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = side - gh % side, side - gw % side
        nh, nw = (gh + ph) // side, (gw + pw) // side
        padded = F.pad(ids, (0, pw, 0, ph), value=-100)
        padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, side * side)
        counts = (padded != -100).sum(-1).reshape(-1)
        flat = padded.reshape(-1)
        index.append(flat[flat != -100] + offset)
        bounds.extend((counts.cumsum(0) * unit + bounds[-1]).tolist())
        offset += t * gh * gw
    cu = torch.unique_consecutive(torch.tensor(bounds, dtype=torch.int32))
    return torch.cat(index) if index else torch.zeros(0, dtype=torch.long), cu


def interpolation_taps(grid_thw: torch.Tensor, side: int, merge: int):
    """Bilinear (align_corners) taps into a side x side table: (N, 4) indices and weights."""
    idx_all, wt_all = [], []
    for t, h, w in grid_thw.tolist():
        def axis(size):
            src = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
            lo = src.floor()
            taps = (lo.long()[:, None] + torch.arange(2)).clamp(0, side - 1)
            wts = (1 - (src[:, None] - lo[:, None] - torch.arange(2)).abs()).clamp(min=0)
            return taps, wts

        (ht, hw_), (wt, ww) = axis(h), axis(w)
        idx = (ht[:, None, :, None] * side + wt[None, :, None, :]).reshape(h, w, 4)
        wts = (hw_[:, None, :, None] * ww[None, :, None, :]).reshape(h, w, 4)
        order = [x.reshape(h // merge, merge, w // merge, merge, 4).transpose(1, 2).reshape(-1, 4)
                 for x in (idx, wts)]
        idx_all.append(order[0].repeat(t, 1))
        wt_all.append(order[1].repeat(t, 1))
    if not idx_all:
        return torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4)
    return torch.cat(idx_all), torch.cat(wt_all)


# ------------------------------------------------------------------ the encoder
class QwenVisionEncoder(MegatronModule):
    """The vision tower of Qwen2.5-VL, Qwen3-VL or Qwen3.5 (see module docstring)."""

    def __init__(self, cfg, *, use_te: bool):
        v = cfg.vision
        tconfig = vision_transformer_config(v, cfg.variant, cfg.recompute)
        self.recompute = cfg.recompute
        super().__init__(config=tconfig)
        self.family, self.v, self.variant = cfg.family, v, cfg.variant
        learned = self.variant.learned_positions
        patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        self.patch_embed = nn.Linear(patch_dim, v.hidden_size, bias=learned)
        if learned:
            self.pos_embed = nn.Embedding(v.num_position_embeddings, v.hidden_size)
        spec = vision_layer_spec(tconfig.normalization, use_te)
        self.layers = nn.ModuleList(build_module(spec, config=tconfig, layer_number=i + 1)
                                    for i in range(v.depth))
        self.merger = PatchMerger(v.hidden_size, v.out_hidden_size, v.spatial_merge_size,
                                  rms=self.variant.vision_norm == "RMSNorm")
        self.deepstack_mergers = nn.ModuleList(
            PatchMerger(v.hidden_size, v.out_hidden_size, v.spatial_merge_size, rms=False,
                        norm_after_merge=True) for _ in v.deepstack_visual_indexes)
        head_dim = v.hidden_size // v.num_heads
        inv = 1.0 / v.rope_theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32)
                                     / (head_dim // 2))
        self.register_buffer("inv_freq", inv, persistent=False)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return tower_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def _rotary(self, grid_thw: torch.Tensor) -> torch.Tensor:
        pos = rotary_positions(grid_thw, self.v.spatial_merge_size).to(self.inv_freq.device)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # (N, head_dim/2): h | w
        return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # megatron (s, 1, 1, dim)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """(sum t*h*w, C*T*P*P) patch rows + (n, 3) grids -> (merged embeds, DeepStack list)."""
        grid_thw = grid_thw.cpu().long()
        unit = self.v.spatial_merge_size ** 2
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        if self.variant.learned_positions:
            side = int(self.v.num_position_embeddings ** 0.5)
            idx, wts = interpolation_taps(grid_thw, side, self.v.spatial_merge_size)
            x = x + (self.pos_embed(idx.to(x.device)) * wts.to(x)[..., None]).sum(1)
        rope = self._rotary(grid_thw).to(x.device)
        full = segment_bounds(grid_thw).to(x.device)
        window = order = None
        if self.variant.windowed:
            order, window = window_layout(grid_thw, self.v.spatial_merge_size,
                                          self.v.window_size, self.v.patch_size)
            order, window = order.to(x.device), window.to(x.device)
            x = x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)
            rope = rope.view(-1, unit, *rope.shape[1:])[order].reshape(rope.shape)
        hidden = x[:, None, :]  # megatron layout (s, b=1, h)
        deepstack = []
        for i, layer in enumerate(self.layers):
            windowed = self.variant.windowed and i not in self.v.fullatt_block_indexes
            bounds = window if windowed else full
            params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds)
            hidden = run_layer(layer, hidden, self.recompute, attention_mask=None,
                               rotary_pos_emb=rope, packed_seq_params=params)
            if i in self.v.deepstack_visual_indexes:
                merger = self.deepstack_mergers[self.v.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(hidden[:, 0]))
        merged = self.merger(hidden[:, 0])
        if order is not None:
            merged = merged[torch.argsort(order)]
        return merged, deepstack
