"""Constants both sides of the batch contract use (docs/internals/batch_contract.md).

This module owns the values the task encoders write into a batch and the models read back from it:
the label of a token without loss, the codes of ``visual_kinds``, and the CLIP pixel normalisation
that the Qwen2.5-VL and Nemotron-Omni processors apply (the data side normalises with it; the
Nemotron-Omni model config records it for export).
"""

from __future__ import annotations

IGNORE_INDEX = -100  #: label of every token without loss
#: ``visual_kinds`` codes: VISUAL_KINDS[code] is the kind of each visual item, in span order
VISUAL_KINDS = ("image", "video")
#: OpenAI CLIP image mean / std (RGB), the processors' normalisation
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
