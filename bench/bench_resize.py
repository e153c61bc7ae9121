"""The exact resizes' kernels against their references, per core, on the size pairs the loader
meets: ``resize_rgb`` (PIL's bicubic on uint8) against ``Image.resize``, ``resize_rgb_float``
(torch's antialiased bicubic in float32) against ``F.interpolate`` on the float32 tensor, and
the float kernel's plain code (what a CPU without AVX2 + FMA runs) against its vector code.

One process, one thread, process CPU time; per size pair one warm-up, then ``--rounds`` rounds in
which every compared path runs once in turn, the least time of each kept (a shared machine only
adds time; ``bench_loader_report.best_cpu``). Every path's values are checked equal to its
reference, bit for bit, before timing.

Usage: python bench/bench_resize.py --out bench_out/resize [--rounds N]
Writes <out>/resize.json and prints the markdown table of docs/benchmarks_task_encoder.md.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import click  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_loader_report import best_cpu  # noqa: E402

from energon_tasks import resize  # noqa: E402

#: (what, (source height, width), (target height, width))
CASES = (
    ("photo enlarged a few % (Nemotron-Omni, Mantis)", (532, 536), (544, 544)),
    ("photo enlarged a few % (Nemotron-Omni, Mantis)", (833, 788), (864, 800)),
    ("photo enlarged 2x", (600, 600), (1200, 1200)),
    ("photo shrunk (Qwen, Mantis)", (600, 800), (448, 608)),
    ("InfoVQA page to the budget", (2300, 1100), (1536, 736)),
    ("large page to the budget", (5000, 2000), (1568, 644)),
    ("video frame", (360, 640), (336, 616)),
)


def pixels_of(height: int, width: int) -> np.ndarray:
    """Photo-like: a smooth ramp with noise and stripes (strokes)."""
    rng = np.random.default_rng(height * 7919 + width)
    ramp = np.add.outer(np.arange(height), 2 * np.arange(width))[..., None] * np.array([1, 3, 7])
    pixels = (ramp % 256 + rng.integers(-20, 21, (height, width, 3))).clip(0, 255)
    pixels = pixels.astype(np.uint8)
    pixels[::9] = 255 - pixels[::9]
    return pixels


def measure(source: tuple[int, int], target: tuple[int, int], rounds: int) -> dict:
    pixels = pixels_of(*source)
    height, width = target
    group = resize._checked("float32", resize._checked_float_rule)[0]
    image = Image.fromarray(pixels)
    paths = {
        "uint8_pil": lambda: np.asarray(image.resize((width, height), Image.BICUBIC)),
        "uint8_ours": lambda: resize.resize_rgb(pixels, width, height),
        "float_torch": lambda: resize.torch_resized(pixels, height, width),
        "float_ours": lambda: resize._native_float(pixels, width, height, group),
        "float_ours_plain": lambda: resize._native_float(pixels, width, height, group,
                                                         plain=True),
    }
    for ours, reference in (("uint8_ours", "uint8_pil"), ("float_ours", "float_torch"),
                            ("float_ours_plain", "float_torch")):
        if not np.array_equal(paths[ours](), paths[reference]()):
            raise RuntimeError(f"{source} -> {target}: {ours} differs from {reference}")
    ms = {name: 1e3 * seconds for name, seconds in
          best_cpu({name: lambda _, path=path: path() for name, path in paths.items()}, 1,
                   rounds).items()}
    return {"source": source, "target": target, "cpu_ms": ms,
            "uint8_speedup": ms["uint8_pil"] / ms["uint8_ours"],
            "float_speedup": ms["float_torch"] / ms["float_ours"],
            "float_plain_speedup": ms["float_torch"] / ms["float_ours_plain"]}


def table(rows: list[dict]) -> str:
    lines = ["| case | source -> target | PIL / ours (uint8) | torch / ours (float32) | "
             "torch / ours, plain code (float32) | ms: PIL, ours, torch, ours, plain |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        ms = row["cpu_ms"]
        (sh, sw), (th, tw) = row["source"], row["target"]
        lines.append(
            f"| {row['what']} | {sw}x{sh} -> {tw}x{th} | {row['uint8_speedup']:.2f}x | "
            f"{row['float_speedup']:.2f}x | {row['float_plain_speedup']:.2f}x | "
            f"{ms['uint8_pil']:.1f}, {ms['uint8_ours']:.1f}, {ms['float_torch']:.1f}, "
            f"{ms['float_ours']:.1f}, {ms['float_ours_plain']:.1f} |")
    return "\n".join(lines)


@click.command()
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--rounds", type=int, default=7)
def main(out: Path, rounds: int) -> None:
    torch.set_num_threads(1)
    rows = [{"what": what, **measure(source, target, rounds)} for what, source, target in CASES]
    result = {"machine": {"cpu": platform.processor() or platform.machine(),
                          "torch": torch.__version__, "torch_cpu": torch.backends.cpu.
                          get_cpu_capability(), "pillow": Image.__version__,
                          "load_average": os.getloadavg()},
              "uint8_kernel": resize.kernel(), "float_kernel": resize.float_kernel(),
              "rounds": rounds, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "resize.json").write_text(json.dumps(result, indent=1))
    print(f"uint8: {result['uint8_kernel']}\nfloat32: {result['float_kernel']}")
    print(table(rows))


if __name__ == "__main__":
    main()
