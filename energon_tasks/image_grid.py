"""What every family's geometry returns and shares: the resize target and patch grid of one image
or video (``ImageGrid``), and the aspect-ratio limit every processor enforces (200, as
transformers' Qwen-VL and Nemotron-Omni processors)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_ASPECT_RATIO = 200


@dataclass(frozen=True, slots=True)
class ImageGrid:
    """Resize target and patch grid of one image or video."""

    resized_height: int  #: pixels, a multiple of the model factor
    resized_width: int  #: pixels, a multiple of the model factor
    grid_thw: tuple[int, int, int]  #: (temporal, height, width) in patches, before the merge
    visual_tokens: int  #: LLM tokens after the spatial merge: t*h*w / merge_size**2


def check_aspect(height: int, width: int) -> None:
    """Refuse a size whose aspect ratio is above ``MAX_ASPECT_RATIO``.

    Raises:
        ValueError: the ratio, named with the size.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        ratio = max(height, width) / min(height, width)
        raise ValueError(
            f"size {height}x{width} (HxW) has aspect ratio {ratio:.1f}, above {MAX_ASPECT_RATIO}"
        )
