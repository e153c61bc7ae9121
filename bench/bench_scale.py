"""Per-core conversion rates at >= 1 GB of input, from partitioned runs, for docs/scale.md.

For each converter, a local source of at least ``--gb`` GB with the hub's layout is generated
(``bench_converters``' makers: Mantis-like parquet + zip of photo JPEGs, InfoVQA-like parquet of
page JPEGs with 5 questions per image, LLaVA-Video-like JSON + tar.gz parts of H.264 clips) and
converted as a SLURM array would convert it: ``python -m converters <name> --num-partitions P
--partition-index i --workers 1`` for i = 0..P-1, one after the other (one core each; the last one
to finish finalizes). Each partition's wall and CPU time (its process and children) are
recorded; the per-core rate is input bytes (and rows) over the summed CPU seconds.

The same is run on a source 50x smaller, which separates the costs that do not grow with the
input: per partition (partition 0: start-up + shard phase) and the finalize step (the last
partition's extra over partition 0: stats, plots, ``energon prepare``). From the two sizes:
shard-phase CPU per row, and finalize = fixed + per row. The projections (``--project``) take
those to the full datasets on N machines of 16 cores: shard phase = full rows (or, when the
full bytes hold more rows of the synthetic size, those) x CPU per row / (16 N), plus one
partition's fixed start-up, plus the serial finalize at the full row count.

Usage: python bench/bench_scale.py --out bench_out/scale [--gb 1.0] [--partitions 2]
       [--only mantis,infovqa,llava-video]
Writes <out>/scale.json and prints the tables of docs/scale.md (measured, then projected).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_converters import make_infovqa, make_mantis, make_video  # noqa: E402


def make_infovqa_parts(root: Path, images: int, rng) -> None:
    """``make_infovqa`` (each page's bytes in each of its 5 rows, as the hub's parquet), then cut
    into files of 250 rows as the hub ships it: one multi-GB file is more than ``datasets`` loads
    (a binary column chunk over 2 GB)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    make_infovqa(root, images, rng)
    whole = root / "data" / "train-00000-of-00001.parquet"
    source = pq.ParquetFile(whole)
    count = math.ceil(source.metadata.num_rows / 250)
    if count == 1:  # the one part would be the whole file itself (written over, then unlinked)
        return
    for k, batch in enumerate(source.iter_batches(batch_size=250)):
        table = pa.Table.from_batches([batch]).replace_schema_metadata(source.schema_arrow.metadata)
        pq.write_table(table, root / "data" / f"train-{k:05d}-of-{count:05d}.parquet")
    whole.unlink()


#: converter -> (maker, items per GB: rows (Mantis, ~2.5 photos of ~100 kB), pages (InfoVQA,
#: ~1.05 MB in each of 5 rows), clips (LLaVA-Video, ~3.3 MB each)). InfoVQA's holds at 1 GB (4
#: files of 250 rows): a page's rows in one file are stored once (parquet's dictionary), so small
#: sources are smaller (--gb 0.05: 0.01 GB, and the size check below stops the run)
MAKERS = {"mantis": (make_mantis, 4200), "infovqa": (make_infovqa_parts, 200),
          "llava-video": (make_video, 320)}


#: the full datasets (the hub's published sizes): bytes, rows
FULL = {"mantis": (85e9, 721_000), "infovqa": (11.6e9, 23_946),
        "llava-video": (1.5e12, 1_300_000)}
MACHINES = (8, 32, 128)
CORES = 16
SMALL = 50  #: the small source is this many times smaller


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def convert_partitions(name: str, source: Path, out: Path, partitions: int) -> list[dict]:
    shutil.rmtree(out, ignore_errors=True)
    runs = []
    for index in range(partitions):
        command = [sys.executable, "-m", "converters", name, "--source", str(source),
                   "--out", str(out), "--num-partitions", str(partitions),
                   "--partition-index", str(index), "--workers", "1"]
        start, cpu = time.perf_counter(), children_cpu()
        proc = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise SystemExit(f"bench_scale: {name} partition {index} exited {proc.returncode}: "
                             f"{last}")
        runs.append({"partition": index, "wall_s": time.perf_counter() - start,
                     "cpu_s": children_cpu() - cpu, "command": " ".join(command[1:])})
    return runs


@click.command()
@click.option("--out", default="bench_out/scale", type=click.Path(path_type=Path))
@click.option("--gb", default=1.0, show_default=True, help="GB of input per converter")
@click.option("--partitions", default=2, show_default=True)
@click.option("--only", default="mantis,infovqa,llava-video", show_default=True)
def main(out: Path, gb: float, partitions: int, only: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "scale.json"
    results = json.loads(report_path.read_text()) if report_path.exists() else {}
    for name in filter(None, only.split(",")):  # --only "": print the tables of <out> again
        make, per_gb = MAKERS[name]
        for size_name, count in (("small", math.ceil(per_gb * gb / SMALL)),
                                 ("big", math.ceil(per_gb * gb))):
            source = out / "src" / (name if size_name == "big" else f"{name}-small")
            if not source.exists():  # generated once, reused by later runs
                start = time.perf_counter()
                make(source, count, np.random.default_rng(0))
                print(f"[bench] {name}: source generated in {time.perf_counter() - start:.0f} s",
                      file=sys.stderr)
            size = folder_bytes(source)
            if size_name == "big" and size < gb * 1e9:
                raise SystemExit(f"{name}: source is {size / 1e9:.2f} GB < {gb} GB: raise "
                                 "MAKERS")
            dataset = out / "dataset" / name
            runs = convert_partitions(name, source, dataset, partitions)
            summary = json.loads((dataset / "summary.json").read_text())
            cpu = sum(r["cpu_s"] for r in runs)
            results.setdefault(name, {})[size_name] = {
                "input_bytes": size, "rows_read": summary["rows_read"],
                "samples_written": summary["samples_written"], "rejected": summary["rejected"],
                "partitions": runs, "cpu_s": cpu, "wall_s": sum(r["wall_s"] for r in runs),
                "mb_per_cpu_s": size / 1e6 / cpu, "rows_per_cpu_s": summary["rows_read"] / cpu,
                "load_average": os.getloadavg(),
            }
            print(f"[bench] {name} {size_name}: {size / 1e9:.3f} GB in {cpu:.0f} CPU s",
                  file=sys.stderr)
            shutil.rmtree(dataset, ignore_errors=True)
            report_path.write_text(json.dumps(results, indent=1))
    print(measured_table(results))
    print()
    print(projection_table(results))


def costs(r: dict) -> dict:
    """Shard-phase CPU per row, finalize fixed + per row, partition start-up (from 2 sizes)."""
    small, big = r["small"], r["big"]
    first = [s["partitions"][0]["cpu_s"] for s in (small, big)]
    final = [s["partitions"][-1]["cpu_s"] - s["partitions"][0]["cpu_s"] for s in (small, big)]
    rows = [s["rows_read"] for s in (small, big)]
    parts = len(big["partitions"])
    per_row = (first[1] - first[0]) / ((rows[1] - rows[0]) / parts)
    final_per_row = max(0.0, (final[1] - final[0]) / (rows[1] - rows[0]))
    return {"shard_cpu_s_per_row": per_row,
            "start_cpu_s": max(0.0, first[0] - per_row * rows[0] / parts),
            "finalize_fixed_cpu_s": max(0.0, final[0] - final_per_row * rows[0]),
            "finalize_cpu_s_per_row": final_per_row,
            "bytes_per_row": big["input_bytes"] / rows[1]}


def measured_table(results: dict) -> str:
    lines = ["| converter | input GB | rows | partitions x workers | CPU s (per partition) | "
             "wall s | MB/s per core | rows/s per core | shard phase, CPU ms per row | "
             "finalize, CPU s fixed + ms per row |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        big, c = r["big"], costs(r)
        per = " + ".join(f"{p['cpu_s']:.0f}" for p in big["partitions"])
        lines.append(
            f"| {name} | {big['input_bytes'] / 1e9:.2f} | {big['rows_read']} | "
            f"{len(big['partitions'])} x 1 | {big['cpu_s']:.0f} ({per}) | {big['wall_s']:.0f} | "
            f"{big['mb_per_cpu_s']:.1f} | {big['rows_per_cpu_s']:.1f} | "
            f"{1000 * c['shard_cpu_s_per_row']:.2f} | {c['finalize_fixed_cpu_s']:.1f} + "
            f"{1000 * c['finalize_cpu_s_per_row']:.2f} |")
    return "\n".join(lines)


def projection_table(results: dict) -> str:
    """PROJECTED wall time of the full datasets (rows x the measured per-row costs)."""
    lines = ["| converter (full: GB, rows) | " + " | ".join(
        f"{m} x {CORES} cores: wall (shard phase + finalize)" for m in MACHINES)
        + " | read bandwidth needed at 128 machines |", "|---" * (len(MACHINES) + 2) + "|"]
    for name, r in results.items():
        full_bytes, full_rows = FULL[name]
        c = costs(r)
        cells = []
        finalize = c["finalize_fixed_cpu_s"] + c["finalize_cpu_s_per_row"] * full_rows
        # rows of the synthetic size that the full bytes would make, when that is more
        work_rows = max(full_rows, full_bytes / c["bytes_per_row"])
        for machines in MACHINES:
            shard = c["start_cpu_s"] + c["shard_cpu_s_per_row"] * work_rows / (CORES * machines)
            cells.append(f"{(shard + finalize) / 60:.1f} min ({shard / 60:.1f} + "
                         f"{finalize / 60:.1f})")
        rate = full_bytes / (c["shard_cpu_s_per_row"] * work_rows / (CORES * MACHINES[-1]))
        lines.append(f"| {name} ({full_bytes / 1e9:,.0f}, {full_rows:,}) | {' | '.join(cells)} "
                     f"| {rate / 1e9:.1f} GB/s |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
