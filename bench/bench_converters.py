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
import resource
import shutil
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import click
import numpy as np
import pyarrow.parquet as pq
from datasets import Features, Image, List, Value

from lookalikes.files import (
    write_card,
    write_json,
    write_parquet,
    write_tar_gz,
    write_zip,
)
from lookalikes.media import encode_h264, photo_jpeg


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


def textured_clip(rng, *, size=(320, 240), fps=25, seconds=6.0, gop=50) -> bytes:
    """An H.264 clip of a moving textured field (realistic bitrate, keyframe every `gop`)."""
    width, height = size
    field = rng.integers(0, 255, (height, width * 2, 3), dtype=np.uint8)
    frames = (field[:, (i * 3) % width:(i * 3) % width + width]
              for i in range(int(fps * seconds)))
    return encode_h264(frames, width=width, height=height, fps=fps,
                       options={"preset": "ultrafast", "g": str(gop)})


def make_video(root: Path, videos: int, rng) -> None:
    config = "0_30_s_bench_v0_1"
    folder = root / config
    folder.mkdir(parents=True)
    members, records = [], []
    for v in range(videos):
        clip = textured_clip(rng)
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
    records, videos = load_video_blobs(root)
    with _tar_writer(out / "floor.tar") as tar:
        for rec in records:
            _add(tar, f"{rec['id']}.vid0.mp4", videos[rec["video"]])
            _add(tar, f"{rec['id']}.json", json.dumps(rec["conversations"]).encode())


def load_video_blobs(root: Path) -> tuple[list[dict], dict[str, bytes]]:
    config = "0_30_s_bench_v0_1"
    records = json.loads((root / config / f"{config}_cap_processed.json").read_text())
    blobs = {}
    for part in sorted((root / config).glob("*.tar.gz")):
        with tarfile.open(part, "r:gz") as src:
            for member in src:
                blobs[member.name.lstrip("./")] = src.extractfile(member).read()
    return records, blobs


def probe_records(records: list[dict], blobs: dict[str, bytes]) -> None:
    from converters.media import probe_video

    for rec in records:  # the converter probes once per annotation record
        probe_video(blobs[rec["video"]])


def convert_timed(command: str, source: Path, out: Path, workers: int) -> tuple[float, float]:
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
        start, cpu = time.perf_counter(), cpu_seconds()
        src = Source(str(source))
        make_source = {"mantis": lambda: MantisSource(src),
                       "infovqa": lambda: InfoVQASource(src),
                       "llava-video": lambda: LlavaVideoSource(src, out / ".work")}[command]
        convert(make_source, Options(out=out, workers=workers, shard_size=200,
                                     val_fraction=0.01))
        return time.perf_counter() - start, cpu_seconds() - cpu


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (workers, `energon prepare`)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn, *args) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one call."""
    start, cpu = time.perf_counter(), cpu_seconds()
    fn(*args)
    return time.perf_counter() - start, cpu_seconds() - cpu


def _median(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return (float(np.median([w for w, _ in runs])), float(np.median([c for _, c in runs])))


def measure(name: str, root: Path, out: Path, workers: int, repeats: int) -> dict:
    """Floor and conversion time of one source folder (median of `repeats` runs each)."""
    floors = {"mantis": floor_mantis, "infovqa": floor_infovqa, "llava-video": floor_video}
    floor_dir = out / f"floor-{root.name}"
    floor_dir.mkdir(parents=True, exist_ok=True)
    floor_s, floor_cpu = _median([timed(floors[name], root, floor_dir) for _ in range(repeats)])
    conv_runs = []
    for k in range(repeats):
        conv_dir = out / f"conv-{root.name}-w{workers}-r{k}"
        shutil.rmtree(conv_dir, ignore_errors=True)
        conv_runs.append(convert_timed(name, root, conv_dir, workers))
    conv_s, conv_cpu = _median(conv_runs)
    shard_s = sum(json.loads(p.read_text())["seconds"]
                  for p in (conv_dir / ".work" / "shards").rglob("*.json"))
    summary = json.loads((conv_dir / "summary.json").read_text())
    return {"input_mb": round(sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
                              / 1e6, 1),
            "rows": summary["rows_read"], "floor_s": round(floor_s, 3),
            "floor_cpu_s": round(floor_cpu, 3), "convert_s": round(conv_s, 3),
            "convert_cpu_s": round(conv_cpu, 3), "shard_phase_s": round(shard_s, 3)}


@click.command()
@click.option("--out", default="bench_out", type=click.Path(path_type=Path))
@click.option("--scale", default=1.0, help="Multiplies the amount of generated data.")
@click.option("--workers", default=2, show_default=True)
@click.option("--repeats", default=3, show_default=True, help="Median of this many runs.")
def main(out: Path, scale: float, workers: int, repeats: int) -> None:
    """Each dataset at sizes N and 2N: the marginal ratio (floor 2N - floor N) / (convert 2N -
    convert N) is the throughput ratio once per-run constants (imports, `energon prepare` start,
    plots) are paid; the end-to-end ratio at 2N is reported beside it."""
    base = {"mantis": int(400 * scale), "infovqa": int(40 * scale), "llava-video": int(12 * scale)}
    makers = {"mantis": make_mantis, "infovqa": make_infovqa, "llava-video": make_video}
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
               "workers": workers}
    for name, make in makers.items():
        runs = []
        for factor in (1, 2):
            root = out / "src" / f"{name}-x{factor}"
            if not root.exists():
                make(root, base[name] * factor, np.random.default_rng(factor))
        # warm-up: imports and first-use costs are paid once per process, not per conversion
        measure(name, out / "src" / f"{name}-x1", out / "warmup", workers, 1)
        for factor in (1, 2):
            runs.append(measure(name, out / "src" / f"{name}-x{factor}", out, workers, repeats))
        small, big = runs
        row = {"small": small, "big": big,
               "marginal_ratio": round((big["floor_s"] - small["floor_s"])
                                       / (big["convert_s"] - small["convert_s"]), 3),
               "marginal_cpu_ratio": round((big["floor_cpu_s"] - small["floor_cpu_s"])
                                           / (big["convert_cpu_s"] - small["convert_cpu_s"]), 3),
               "end_to_end_cpu_ratio": round(big["floor_cpu_s"] / big["convert_cpu_s"], 3),
               "end_to_end_ratio": round(big["floor_s"] / big["convert_s"], 3),
               "fixed_cost_s": round(small["convert_s"] - (big["convert_s"] - small["convert_s"]),
                                     3)}
        if name == "llava-video":
            _, probe_cpu = timed(probe_records, *load_video_blobs(out / "src" / f"{name}-x2"))
            row["probe_cpu_s"] = round(probe_cpu, 3)
            row["probe_share"] = round(probe_cpu / big["convert_cpu_s"], 3)
        results[name] = row
    (out / "converters.json").write_text(json.dumps(results, indent=1))
    click.echo(f"| converter | rows N / 2N | input MB 2N | floor CPU s N / 2N | convert CPU s "
               f"N / 2N ({workers} workers) | marginal CPU ratio | end-to-end CPU ratio 2N | "
               "wall s 2N floor / convert | end-to-end wall ratio 2N |")
    click.echo("|---|---|---|---|---|---|---|---|---|")
    for name in makers:
        r = results[name]
        s, b = r["small"], r["big"]
        click.echo(f"| {name} | {s['rows']} / {b['rows']} | {b['input_mb']} | "
                   f"{s['floor_cpu_s']} / {b['floor_cpu_s']} | {s['convert_cpu_s']} / "
                   f"{b['convert_cpu_s']} | {r['marginal_cpu_ratio']} | "
                   f"{r['end_to_end_cpu_ratio']} | {b['floor_s']} / {b['convert_s']} | "
                   f"{r['end_to_end_ratio']} |")
    v = results["llava-video"]
    click.echo(f"\nvideo probing: {v['probe_cpu_s']} CPU s = {v['probe_share']:.1%} of the "
               "LLaVA-Video conversion's CPU time at 2N")


if __name__ == "__main__":
    main()
