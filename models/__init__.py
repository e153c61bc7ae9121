"""The models: megatron-core VLMs (Qwen2.5-VL / Qwen3-VL, Nemotron-Omni) with their vision towers,
vision data parallel over CP, HF weight import / export (``python -m models.convert``), greedy
generation, checkpoints and run state, and the CPU accommodations (``models.cpu``). Model code
only: it imports neither the data side (energon_tasks, converters) nor the recipes."""
