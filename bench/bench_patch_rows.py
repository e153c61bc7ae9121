"""The Qwen ViT's patch rows (``QwenVLGeometry.pixel_rows``: normalise + patchify, both temporal
slots) through the C kernel (``energon_tasks._resample.patch_rows``) against the numpy path and
against the reference ``patchify(normalize(...))``, per core, on the sizes the loader meets.

One process, one thread, process CPU time; per case one warm-up, then ``--rounds`` rounds in
which every path runs once in turn, the least time of each kept (a shared machine only adds
time; ``bench_loader_report.best_cpu``). Every path's rows are checked equal to the reference
bit for bit before timing. Each kernel runs into a new array per call (``fresh``: what the
loader does, so the first touch of the array's pages is in the time) and into one array reused
(``warm``: the pass alone). Reported: ms per image, the C kernel's speed-up, and the GB/s of
float32 rows it writes warm.

Usage: python bench/bench_patch_rows.py --out bench_out/patch_rows [--rounds N]
Writes <out>/patch_rows.json and prints a markdown table (docs/benchmarks_task_encoder.md).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_loader_report import best_cpu  # noqa: E402
from bench_resize import pixels_of  # noqa: E402

from energon_tasks.families.qwen_vl import geometry as qwen_geometry  # noqa: E402
from energon_tasks.profiles import get_geometry  # noqa: E402

#: (what, model, (height, width) of the resized image: multiples of the model's factor)
CASES = (
    ("photo (Mantis)", "qwen2.5-vl", (448, 616)),
    ("photo (Mantis)", "qwen3-vl", (448, 608)),
    ("InfoVQA page", "qwen2.5-vl", (1540, 728)),
    ("InfoVQA page", "qwen3-vl", (1536, 736)),
    ("large page", "qwen3-vl", (2560, 1024)),
)


def measure(model: str, size: tuple[int, int], rounds: int) -> dict:
    """ms per image of each path: ``fresh``, rows into a new array per call (the loader's case:
    the first touch of its pages is paid too), ``warm``, into one array reused (the pass alone)."""
    geo = get_geometry(model)
    frames = pixels_of(*size)[None]
    native = qwen_geometry._native_patch_rows
    if native is None:
        raise click.ClickException("energon_tasks._resample is not built (make install)")
    warm = geo.pixel_rows(frames)

    def numpy_rows(out=None):
        qwen_geometry._native_patch_rows = None
        try:
            return geo.pixel_rows(frames, out=out)
        finally:
            qwen_geometry._native_patch_rows = native

    paths = {"C fresh": lambda: geo.pixel_rows(frames), "numpy fresh": numpy_rows,
             "C warm": lambda: geo.pixel_rows(frames, out=warm),
             "numpy warm": lambda: numpy_rows(warm),
             "reference": lambda: geo.patchify(geo.normalize(frames.transpose(0, 3, 1, 2)))}
    expected = paths["reference"]()
    for name, path in paths.items():
        if not np.array_equal(path(), expected):
            raise RuntimeError(f"{model} {size}: {name} differs from the reference")
    seconds = best_cpu({name: lambda _, path=path: path() for name, path in paths.items()}, 1,
                       rounds)
    ms = {name: 1e3 * s for name, s in seconds.items()}
    return {"model": model, "size": size, "cpu_ms": ms,
            "fresh_over_numpy": ms["numpy fresh"] / ms["C fresh"],
            "warm_over_numpy": ms["numpy warm"] / ms["C warm"],
            "over_reference": ms["reference"] / ms["C fresh"],
            "warm_gb_per_s": expected.nbytes / seconds["C warm"] / 1e9}


def table(rows: list[dict]) -> str:
    lines = ["| case | model | size | ms: C fresh, numpy fresh, C warm, numpy warm, reference | "
             "numpy / C, fresh | numpy / C, warm | reference / C fresh | C warm writes |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ms = row["cpu_ms"]
        height, width = row["size"]
        lines.append(
            f"| {row['what']} | {row['model']} | {width}x{height} | "
            f"{', '.join(f'{ms[k]:.2f}' for k in ms)} | {row['fresh_over_numpy']:.2f}x | "
            f"{row['warm_over_numpy']:.2f}x | {row['over_reference']:.2f}x | "
            f"{row['warm_gb_per_s']:.1f} GB/s |")
    return "\n".join(lines)


@click.command()
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--rounds", type=int, default=7)
def main(out: Path, rounds: int) -> None:
    rows = [{"what": what, **measure(model, size, rounds)} for what, model, size in CASES]
    result = {"machine": {"cpu": platform.processor() or platform.machine(),
                          "numpy": np.__version__, "load_average": os.getloadavg()},
              "rounds": rounds, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "patch_rows.json").write_text(json.dumps(result, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
