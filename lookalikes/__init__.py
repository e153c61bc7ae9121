"""Test and demo scaffolding: small local lookalikes of the three Hugging Face source datasets.

This package owns what only tests, bench/ and `make demo` need, kept out of the product packages:
the dataset lookalikes (this module and its builders), the demo data builder (`lookalikes.demo`,
`python -m lookalikes.demo`) and synthetic model inputs shared by tests and bench
(`lookalikes.model_inputs`). The product (converters, energon_tasks, models) never imports it.

Each builder writes a folder with exactly the hub's schema and file layout (README.md `configs:`
card, parquet or JSON annotation files, image zips or video tar.gz parts), so that the converters'
real code path `datasets.load_dataset(<folder>, <config>, split=...)` runs on it unchanged, plus
`lookalike_manifest.json` with the ground truth a converter must reproduce (rows per split,
expected rejects by reason, fixups by kind, samples per split, and where each pitfall lives).

    from lookalikes import build_all
    roots = build_all(tmp_path)          # {"mantis": ..., "infovqa": ..., "llava-video": ...}

Command line: `python -m lookalikes --out DIR [--only mantis,infovqa,llava-video]`.
"""

from __future__ import annotations

from pathlib import Path

from .files import MANIFEST_NAME
from .infovqa import build_infovqa
from .llava_video import build_llava_video
from .mantis import build_mantis

__all__ = ["MANIFEST_NAME", "build_all", "build_infovqa", "build_llava_video", "build_mantis"]


def build_all(root: Path, *, pitfalls: bool = True, seed: int = 0) -> dict[str, Path]:
    """Build the three lookalikes (default sizes) under `root`.

    Args:
        root: Parent folder; `Mantis-Instruct`, `InfoVQA` and `LLaVA-Video-178K` are replaced.
        pitfalls: Plant the pitfalls listed in each builder's manifest.
        seed: Everything is a function of the seed.

    Returns:
        {"mantis": path, "infovqa": path, "llava-video": path}, each a dataset root.
    """
    return {
        "mantis": build_mantis(root, pitfalls=pitfalls, seed=seed),
        "infovqa": build_infovqa(root, pitfalls=pitfalls, seed=seed),
        "llava-video": build_llava_video(root, pitfalls=pitfalls, seed=seed),
    }
