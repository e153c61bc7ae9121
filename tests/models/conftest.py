"""Tiny random-weight Qwen2.5-VL / Qwen3-VL models built with transformers (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_hf import build_tiny_hf


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_hf")
    return {f: build_tiny_hf(f, root / f) for f in ("qwen2_5_vl", "qwen3_vl")}
