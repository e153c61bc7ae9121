"""Conversion throughput of each converter side by side with the floor of a raw copy, in one run.

The floor reads the same bytes (zip members / parquet image bytes / tar.gz video members) and
writes them into tar files with no other work. Each converter is timed end to end as a user runs
it (`load_dataset` with a fresh cache, probing, shards, accounting, stats, `energon prepare`).
Video: the time spent probing all videos with PyAV, as a share of the LLaVA-Video conversion.

Usage: python bench/bench_converters.py --out bench_out [--scale 1.0]
Writes bench_out/converters.json and prints a markdown table (copied into docs/benchmarks.md).
"""

from __future__ import annotations

import io
import json
import os
import platform
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import click
import numpy as np
import pyarrow.parquet as pq
from datasets import Features, Image, List, Value
from PIL import Image as PILImage

from converters.lookalikes.files import write_card, write_json, write_parquet, write_tar_gz
from converters.lookalikes.files import write_zip
from converters.lookalikes.media import moving_square_clip


def photo_jpeg(rng: np.random.Generator, width: int, height: int) -> bytes:
    """A photo-like JPEG (smooth colour field + grain), so sizes and decode costs are realistic."""
    base = rng.integers(0, 255, (height // 32 + 2, width // 32 + 2, 3), dtype=np.uint8)
    img = PILImage.fromarray(base).resize((width, height), PILImage.BICUBIC)
    arr = np.asarray(img, dtype=np.int16) + rng.integers(-12, 12, (height, width, 3))
    buf = io.BytesIO()
    PILImage.fromarray(arr.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def make_mantis(root: Path, rows: int, rng) -> None:
    members, records = [], []
    for r in range(rows):
        n = int(rng.integers(1, 5))
        paths = [f"bench/{r:05d}_{k}.jpg" for k in range(n)]
        for p in paths:
            members.append((p, photo_jpeg(rng, int(rng.integers(400, 900)),
                                          int(rng.integers(300, 700)))))
        records.append({"id": f"bench_{r}", "images": [{"bytes": None, "path": p} for p in paths],
                        "conversation": [{"role": "user", "content": "<image>" * n + " Compare."},
                                         {"role": "assistant", "content": "They differ."}],
                        "source": "bench"})
    features = Features({"id": Value("string"),
                         "images": List({"bytes": Value("binary"), "path": Value("string")}),
                         "conversation": List({"role": Value("string"),
                                               "content": Value("string")}),
                         "source": Value("string")})
    write_parquet(root / "bench" / "train-00000-of-00001.parquet", records, features,
                  hf_metadata=True)
    write_zip(root / "bench" / "train_images.zip", members)
    write_card(root, {"bench": {"train": "bench/train-*.parquet"}}, "bench", "")


def make_infovqa(root: Path, images: int, rng) -> None:
    records = []
    for i in range(images):
        data = photo_jpeg(rng, int(rng.integers(1000, 1700)), int(rng.integers(1800, 4200)))
        for q in range(5):
            records.append({"image": {"bytes": data, "path": None},
                            "question": f"What is value {q} of chart {i}?", "answer": [str(q)]})
    order = rng.permutation(len(records))
    features = Features({"image": Image(), "question": Value("string"),
                         "answer": List(Value("string"))})
    write_parquet(root / "data" / "train-00000-of-00001.parquet",
                  [records[k] for k in order], features, hf_metadata=True)
    write_card(root, {"default": {"train": "data/train-*.parquet"}}, "bench", "")


def make_video(root: Path, videos: int, rng) -> None:
    config = "0_30_s_bench_v0_1"
    folder = root / config
    folder.mkdir(parents=True)
    members, records = [], []
    for v in range(videos):
        clip = moving_square_clip("right", "red", size=(320, 240), seconds=8.0, fps=25)
        members.append((f"./bench/{v:04d}.mp4", clip))
        for kind in ("cap", "oe"):
            records.append({"id": f"{kind}_{v}", "video": f"bench/{v:04d}.mp4",
                            "data_source": "bench",
                            "conversations": [{"from": "human", "value": "<image>\nDescribe."},
                                              {"from": "gpt", "value": "A square moves."}]})
    half = len(members) // 2
    write_tar_gz(folder / f"{config}_videos_1.tar.gz", members[:half])
    write_tar_gz(folder / f"{config}_videos_2.tar.gz", members[half:])
    write_json(folder / f"{config}_cap_processed.json", records)
    write_card(root, {config: {"caption": f"{config}/{config}_cap_processed.json"}}, "bench", "")


def _tar_writer(path: Path):
    return tarfile.open(path, "w")


def _add(tar, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def floor_mantis(root: Path, out: Path) -> None:
    table = pq.read_table(root / "bench" / "train-00000-of-00001.parquet").to_pylist()
    with zipfile.ZipFile(root / "bench" / "train_images.zip") as zf, \
            _tar_writer(out / "floor.tar") as tar:
        for row in table:
            for k, image in enumerate(row["images"]):
                _add(tar, f"{row['id']}.img{k}.jpg", zf.read(image["path"]))
            _add(tar, f"{row['id']}.json", json.dumps(row["conversation"]).encode())


def floor_infovqa(root: Path, out: Path) -> None:
    table = pq.read_table(root / "data" / "train-00000-of-00001.parquet")
    seen = set()
    with _tar_writer(out / "floor.tar") as tar:
        for r, row in enumerate(table.to_pylist()):
            data = row["image"]["bytes"]
            if hash(data) not in seen:
                seen.add(hash(data))
                _add(tar, f"s{r}.img0.jpg", data)
            _add(tar, f"s{r}.json", json.dumps([row["question"], row["answer"]]).encode())


def floor_video(root: Path, out: Path) -> None:
    config = "0_30_s_bench_v0_1"
    records = json.loads((root / config / f"{config}_cap_processed.json").read_text())
    videos = {}
    for part in sorted((root / config).glob("*.tar.gz")):
        with tarfile.open(part, "r:gz") as src:
            for member in src:
                videos[member.name.lstrip("./")] = src.extractfile(member).read()
    with _tar_writer(out / "floor.tar") as tar:
        for rec in records:
            _add(tar, f"{rec['id']}.vid0.mp4", videos[rec["video"]])
            _add(tar, f"{rec['id']}.json", json.dumps(rec["conversations"]).encode())


def probe_all_videos(root: Path) -> float:
    from converters.media import probe_video

    config = "0_30_s_bench_v0_1"
    records = json.loads((root / config / f"{config}_cap_processed.json").read_text())
    blobs = {}
    for part in sorted((root / config).glob("*.tar.gz")):
        with tarfile.open(part, "r:gz") as src:
            for member in src:
                blobs[member.name.lstrip("./")] = src.extractfile(member).read()
    start = time.perf_counter()
    for rec in records:  # the converter probes once per annotation record
        probe_video(blobs[rec["video"]])
    return time.perf_counter() - start


def convert_timed(command: str, source: Path, out: Path, workers: int) -> float:
    """Time one conversion as the CLI runs it, with a fresh `datasets` cache."""
    from converters.base import UsageError  # noqa: F401  (import cost outside the timing)
    from converters.hub import Source
    from converters.infovqa import InfoVQASource
    from converters.llava_video import LlavaVideoSource
    from converters.mantis import MantisSource
    from converters.pipeline import Options, convert

    with tempfile.TemporaryDirectory() as cache:
        os.environ["HF_DATASETS_CACHE"] = cache
        import datasets

        datasets.config.HF_DATASETS_CACHE = Path(cache)
        start = time.perf_counter()
        src = Source(str(source))
        dataset = {"mantis": lambda: MantisSource(src),
                   "infovqa": lambda: InfoVQASource(src),
                   "llava-video": lambda: LlavaVideoSource(src, out / ".work")}[command]()
        convert(dataset, Options(out=out, workers=workers, shard_size=200, val_fraction=0.01))
        return time.perf_counter() - start


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


@click.command()
@click.option("--out", default="bench_out", type=click.Path(path_type=Path))
@click.option("--scale", default=1.0, help="Multiplies the amount of generated data.")
def main(out: Path, scale: float) -> None:
    rng = np.random.default_rng(0)
    src = out / "src"
    sizes = {"mantis": int(300 * scale), "infovqa": int(40 * scale), "llava-video": int(24 * scale)}
    makers = {"mantis": make_mantis, "infovqa": make_infovqa, "llava-video": make_video}
    floors = {"mantis": floor_mantis, "infovqa": floor_infovqa, "llava-video": floor_video}
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    for name, make in makers.items():
        root = src / name
        if not root.exists():
            make(root, sizes[name], rng)
        input_mb = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 1e6
        floor_dir = out / f"floor-{name}"
        floor_dir.mkdir(parents=True, exist_ok=True)
        floor_s = timed(floors[name], root, floor_dir)
        row = {"input_mb": round(input_mb, 1), "floor_s": round(floor_s, 3)}
        for workers in (1, 2):
            conv_s = convert_timed(name, root, out / f"conv-{name}-w{workers}", workers)
            row[f"convert_w{workers}_s"] = round(conv_s, 3)
            row[f"ratio_w{workers}"] = round(floor_s / conv_s, 3)
        summary = json.loads((out / f"conv-{name}-w1" / "summary.json").read_text())
        row["rows"] = summary["rows_read"]
        row["samples"] = summary["samples_written"]
        if name == "llava-video":
            probe_s = probe_all_videos(root)
            row["probe_s"] = round(probe_s, 3)
            row["probe_share"] = round(probe_s / row["convert_w1_s"], 3)
        results[name] = row
    (out / "converters.json").write_text(json.dumps(results, indent=1))
    click.echo("| converter | rows | input MB | floor s | convert s (1 proc) | ratio | "
               "convert s (2 workers) | ratio |")
    click.echo("|---|---|---|---|---|---|---|---|")
    for name in makers:
        r = results[name]
        click.echo(f"| {name} | {r['rows']} | {r['input_mb']} | {r['floor_s']} | "
                   f"{r['convert_w1_s']} | {r['ratio_w1']} | {r['convert_w2_s']} | "
                   f"{r['ratio_w2']} |")
    v = results["llava-video"]
    click.echo(f"\nvideo probing: {v['probe_s']} s = {v['probe_share']:.1%} of the LLaVA-Video "
               "conversion (1 process)")


if __name__ == "__main__":
    main()
