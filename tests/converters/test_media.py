"""Image and video probing: format from content, truncation caught, re-encode of odd formats."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from converters.media import MediaError, probe_image


def _encoded(fmt: str) -> bytes:
    noise = np.random.default_rng(0).integers(0, 255, (80, 120, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt, ext", [("JPEG", "jpg"), ("PNG", "png"), ("WEBP", "webp"),
                                      ("GIF", "gif"), ("BMP", "bmp")])
def test_format_from_content_and_original_bytes_kept(fmt, ext):
    data = _encoded(fmt)
    probed = probe_image(data, "named_wrongly.png")
    assert (probed.ext, probed.width, probed.height) == (ext, 120, 80)
    assert probed.data == data and probed.reencoded_from is None


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize("cut", [0.5, 0.95])
def test_truncated_images_are_rejected(fmt, cut):
    data = _encoded(fmt)
    with pytest.raises(MediaError) as err:
        probe_image(data[: int(len(data) * cut)], "x")
    assert err.value.reason == "undecodable_image" and "0x" not in err.value.detail


def test_format_loaders_do_not_read_is_reencoded_losslessly():
    data = _encoded("PPM")
    probed = probe_image(data, "x.ppm")
    assert (probed.ext, probed.reencoded_from) == ("png", "ppm")
    original = Image.open(io.BytesIO(data)).convert("RGB")
    assert Image.open(io.BytesIO(probed.data)).convert("RGB").tobytes() == original.tobytes()


@pytest.mark.parametrize("fmt, mode, options", [
    ("JPEG", "RGB", {"progressive": True}), ("JPEG", "CMYK", {}), ("JPEG", "L", {}),
    ("PNG", "P", {}), ("PNG", "LA", {}), ("PNG", "I;16", {})])
def test_header_sizes_match_pil(fmt, mode, options):
    rgb = np.random.default_rng(1).integers(0, 255, (37, 91, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).convert(mode if mode != "I;16" else "L").convert(mode).save(
        buf, fmt, **options)
    probed = probe_image(buf.getvalue(), "x")
    assert (probed.width, probed.height, probed.format) == (91, 37, fmt.lower())
