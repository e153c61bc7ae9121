"""Layers and layer settings shared by more than one family (a family package never imports
another): the Qwen ViT and its shape, the vision towers' transformer layers, segment-confined
attention, the Gated DeltaNet mixer with its decode step, norms megatron-core lacks, M-RoPE
positions, activation recompute, the MoE routers' shared settings and metrics, and LatentMoE
without TransformerEngine (``latent_moe``). Building blocks only: no family, checkpoint, HF folder
or generation loop is imported here."""
