"""What the load-time integrity check costs: SHA-256 of each media member next to the decode the
loader does anyway, in one run, as a ratio.

Media like the datasets': InfoVQA-like text pages (JPEG, 1000x3000 and 2000x5000), Mantis-like
photos (JPEG, ~600x450) and LLaVA-Video-like clips (H.264, 30 s at 30 fps, 2 s keyframes, 16
frames sampled). The decode is the loader's own (`energon_tasks.decode`) at the sizes the Qwen2.5-VL
budget plans by default (max_pixels 1003520); the check is `conversation_fields`, which hashes
every member of a sample against its K.json entry. Median of `--repeats` runs, CPU time of this
process.

Usage: python bench/bench_integrity.py [--repeats 5] [--out bench_out/integrity.json]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import numpy as np

from energon_tasks.decode import decode_image
from energon_tasks.energon_dataset import conversation_fields
from energon_tasks.profiles import get_geometry
from energon_tasks.sample_format import CanonicalSample, Media, SourceRef, Turn
from energon_tasks.video_decode import decode_video_frames
from lookalikes.media import encode_h264, photo_jpeg, text_page


def _page(width: int, height: int) -> bytes:
    import io

    lines = [(f"line {i}: numbers {i * 37 % 1000} and words", 28) for i in range(height // 60)]
    image = text_page((width, height), lines)
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _clip() -> bytes:
    rng = np.random.default_rng(0)
    texture = rng.integers(0, 256, (360, 4 * 640, 3), dtype=np.uint8)
    frames = (texture[:, (4 * i) % (3 * 640):(4 * i) % (3 * 640) + 640] for i in range(900))
    return encode_h264(frames, width=640, height=360, fps=30,
                       options={"g": "60", "keyint_min": "60", "sc_threshold": "0"})


def _cpu(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def _sample_parts(kind: str, data: bytes, width: int, height: int) -> dict:
    import hashlib

    part = "img0.jpg" if kind == "image" else "vid0.mp4"
    media = Media(part=part, kind=kind, format="jpeg" if kind == "image" else "mp4",
                  width=width, height=height, bytes=len(data),
                  sha256=hashlib.sha256(data).hexdigest(),
                  **({} if kind == "image" else {"duration_s": 30.0, "frames": 900, "fps": 30.0,
                                                 "codec": "h264"}))
    sample = CanonicalSample(dataset="bench", source=SourceRef(config="c", split="train",
                                                               ids=["x"], rows=[0]),
                             conversation=[Turn(role="user", content=f"<{kind}>q"),
                                           Turn(role="assistant", content="a")],
                             media=[media])
    return {"json": sample.to_json_bytes(), part: data}


@click.command()
@click.option("--repeats", default=5, show_default=True, help="Runs per measurement (median).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_out/integrity.json"),
              show_default=True, help="Where the JSON result goes.")
def main(repeats: int, out: Path) -> None:
    """SHA-256 verification vs decode time per medium (see the module docstring)."""
    geo = get_geometry("qwen2.5-vl")
    rng = np.random.default_rng(0)
    cases = {"infovqa page 1000x3000": (_page(1000, 3000), 1000, 3000),
             "infovqa page 2000x5000": (_page(2000, 5000), 2000, 5000),
             "mantis photo 600x450": (photo_jpeg(rng, 600, 450), 600, 450)}
    rows = []
    for name, (data, width, height) in cases.items():
        grid = geo.image_grid(height, width, min_pixels=200_704, max_pixels=1_003_520)
        size = (grid.grid_thw[1] * geo.patch_size, grid.grid_thw[2] * geo.patch_size)
        parts = _sample_parts("image", data, width, height)
        check = _cpu(lambda parts=parts: conversation_fields("k", parts), repeats)
        decode = _cpu(lambda data=data, size=size: decode_image(data, size=size,
                                                                max_source_pixels=10**9), repeats)
        rows.append({"medium": name, "bytes": len(data), "check_ms": check * 1e3,
                     "decode_ms": decode * 1e3, "ratio": check / decode})
    clip = _clip()
    picks = [round(i * 899 / 15) for i in range(16)]
    parts = _sample_parts("video", clip, 640, 360)
    check = _cpu(lambda: conversation_fields("k", parts), repeats)
    decode = _cpu(lambda: decode_video_frames(clip, picks, size=(336, 588),
                                              max_source_pixels=10**9), repeats)
    rows.append({"medium": "llava-video clip 640x360 30 s (16 frames)", "bytes": len(clip),
                 "check_ms": check * 1e3, "decode_ms": decode * 1e3, "ratio": check / decode})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print("| medium | bytes | SHA-256 check (ms) | loader decode (ms) | check / decode |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['medium']} | {r['bytes']:,} | {r['check_ms']:.2f} | {r['decode_ms']:.1f} | "
              f"{r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
