"""The published loader benchmark (``make bench-loader`` -> docs/loader-benchmark.md).

Per family (Qwen2.5-VL, Qwen3-VL, Nemotron-Omni dynamic: the three processors the task encoder
reproduces; Qwen3-VL MoE and Qwen3.5 read Qwen3-VL's processor and tiled Nemotron-Omni PIL's
uint8 resize, the Qwen path's kernel) and dataset shape, the project's loader end to end
(``encode_sample``'s steps from the stored bytes: decode, resize, normalise, patchify, tokens,
labels, positions) against every Hugging Face path users run (``bench/loader_reference.py``:
qwen-vl-utils' ``fetch_image`` / ``fetch_video`` with transformers' torchvision or PIL image
processor, the processors alone, torchcodec and decord with the families' video processors);
the reference side runs in ``make infer-venv``'s venv (torch + torchvision), the project's in
its own.

Measured per core: one process each, one thread, process CPU time (``time.process_time`` in
the process that runs the path: this one for the project, the reference worker for the HF
paths; the IPC between them is outside both clocks). One warm-up round, then ``--rounds`` rounds;
in each round every sample runs every path in turn (the order rotated each round), so the
machine's load drifts over all paths alike, and both processes run on one core, a different one
each round (``OneCore``): a core slowed by its neighbours slows all paths of a round. Reported:
the median over rounds of each path's CPU ms per sample, samples/s per core (1000 / ms), and
for each HF path the median and the range of the per-round ratio HF / project. The pixels each
HF path returns are compared with the project's (``pixel_values``: equal bit for bit, or the
largest difference, in normalised units).

Sets (generated; sizes as the hub's datasets show): Mantis-like samples of 10 photo JPEGs (the
task encoder's default ``max_num_images``) of 400-900 px a side; InfoVQA-like text pages
800-1400 x 1400-3200 (the dataset's median is ~2 MP), large pages 1500-2500 x 4000-6000 and a
6000x9000 page; LLaVA-Video-like 640x360 clips: the
project's lookalike-style H.264 (2 s GOP, B-frames) and clips of other content and encoders
(``bench_video_decode.FOREIGN``: x264 at its defaults: scene-cut keyframes, GOP up to 250).
The task encoder's defaults with
``seq_length`` 16384. The decode floor of an image set (full JPEG decode of each image, PIL) is
in the same table: no exact path can skip it.

Usage: python bench/bench_loader.py --out bench_out/loader_bench --doc docs/loader-benchmark.md
       [--rounds 7] [--quick] [--no-pin] [--infer-venv .venv-infer]
"""

from __future__ import annotations

import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import click  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_loader_report import make_encoder  # noqa: E402
from bench_task_encoder import conversation_of, document_jpeg, make_video, ours_path  # noqa: E402
from bench_video_decode import FOREIGN, clip_bytes, link_pyav_ffmpeg  # noqa: E402
from loader_reference import IMAGE_PATHS, VIDEO_PATHS  # noqa: E402

from energon_tasks.resize import float_kernel, kernel  # noqa: E402
from lookalikes.media import photo_jpeg  # noqa: E402

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "nemotron_omni")
SETS = ("mantis", "infovqa", "infovqa_large", "infovqa_6000x9000", "llava_video")
VIDEO_CLIPS = ("lookalike_h264_gop2", "x264_defaults_film")
#: what the reference venv adds to make infer-venv's, each without its dependencies (none of
#: them may bring another torch): qwen-vl-utils needs av and requests
REFERENCE_PACKAGES = ("qwen-vl-utils==0.0.14", "av==18.1.0", "decord==0.6.0",
                      "torchcodec==0.17.0", "requests", "urllib3", "certifi",
                      "charset-normalizer")
LABELS = {"mantis": "Mantis-like, 10 photos 400-900 px", "infovqa":
          "InfoVQA-like pages 800-1400 x 1400-3200", "infovqa_large":
          "InfoVQA-like pages 1500-2500 x 4000-6000", "infovqa_6000x9000":
          "InfoVQA-like page 6000x9000", "llava_video": "LLaVA-Video-like clips"}


# ---- data --------------------------------------------------------------------------------------


def image_sets(quick: bool) -> dict[str, list[list[bytes]]]:
    rng = np.random.default_rng(0)

    def photos():
        return [photo_jpeg(rng, int(rng.integers(400, 901)), int(rng.integers(400, 901)))
                for _ in range(10)]  # the task encoder's max_num_images

    def pages(low_w, high_w, low_h, high_h, count):
        return [[document_jpeg(rng, int(rng.integers(low_w, high_w + 1)),
                               int(rng.integers(low_h, high_h + 1)))] for _ in range(count)]

    return {"mantis": [photos() for _ in range(1 if quick else 3)],
            "infovqa": pages(800, 1400, 1400, 3200, 2 if quick else 4),
            "infovqa_large": pages(1500, 2500, 4000, 6000, 1 if quick else 2),
            "infovqa_6000x9000": [[document_jpeg(rng, 6000, 9000)]]}


def video_clips(cache: Path, quick: bool) -> dict[str, bytes]:
    names = VIDEO_CLIPS[:1] if quick else VIDEO_CLIPS
    clips = {}
    for name in names:
        if name == "lookalike_h264_gop2":
            path = cache / f"{name}.mp4"
            if not path.exists():
                cache.mkdir(parents=True, exist_ok=True)
                path.write_bytes(make_video(30, 30, 640, 360, 60))
            clips[name] = path.read_bytes()
        else:
            clips[name] = clip_bytes(name, cache)
    return clips


def clip_sample(data: bytes):
    """A canonical one-turn sample holding one clip, with the metadata the converter records
    (frames counted from the packets: a WebM header has no count)."""
    import av

    from energon_tasks.sample_format import CanonicalSample, Media, SourceRef, Turn

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = sum(1 for p in container.demux(stream) if p.size)
        fps, codec = float(stream.average_rate), stream.codec_context.name
        width, height = stream.width, stream.height
        fmt = {"matroska": "webm", "mov": "mp4"}.get(container.format.name.split(",")[0],
                                       container.format.name.split(",")[0])
    media = Media(part=f"vid0.{fmt}", kind="video", format=fmt, width=width, height=height,
                  bytes=len(data), duration_s=frames / fps, frames=frames, fps=fps, codec=codec)
    sample = CanonicalSample(
        dataset="bench", source=SourceRef(config="bench", split="train", ids=["v"], rows=[0]),
        conversation=[Turn(role="user", content="<image> What happens?"),
                      Turn(role="assistant", content="The scene pans slowly to the left.")],
        media=[media])
    return sample, {media.part: data}


# ---- the reference worker ----------------------------------------------------------------------


def reference_python(infer_venv: Path, folder: Path) -> tuple[Path | None, str]:
    """The interpreter of the reference side: ``folder``, a venv over ``infer_venv``'s packages
    (a ``.pth`` line) with ``REFERENCE_PACKAGES`` added, built once; (None, why) without it."""
    infer_python = infer_venv / "bin" / "python"
    if not infer_python.exists():
        return None, (f"no {infer_venv} (make infer-venv builds it): the Hugging Face paths "
                      "are not measured")
    python = folder / "bin" / "python"
    stamp = folder / ".installed"
    if not stamp.exists():
        site = subprocess.run([str(infer_python), "-c", "import site; print(site.getsitepackages()"
                               "[0])"], capture_output=True, text=True, check=True).stdout.strip()
        subprocess.run([str(infer_python.resolve()), "-m", "venv", str(folder)], check=True)
        own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                             capture_output=True, text=True, check=True).stdout.strip()
        Path(own, "infer_venv.pth").write_text(site + "\n")
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                               *REFERENCE_PACKAGES], capture_output=True, text=True)
        if done.returncode:
            return None, f"pip could not install {' '.join(REFERENCE_PACKAGES)}: " + (
                done.stderr.strip().splitlines() or ["?"])[-1]
        stamp.write_text(" ".join(REFERENCE_PACKAGES))
    return python, ""


class Reference:
    """The reference worker: one subprocess in the reference venv, one request at a time."""

    def __init__(self, python: Path, ffmpeg_libs: Path | None):
        env = dict(os.environ, PYTHONPATH="")
        if ffmpeg_libs:  # torchcodec decodes with the FFmpeg PyAV bundles, as the project
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (str(ffmpeg_libs), os.environ.get("LD_LIBRARY_PATH")) if p)
        self.process = subprocess.Popen(
            [str(python), str(ROOT / "bench" / "loader_reference.py")], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the reference worker stopped")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def family_settings(encoder) -> dict:
    """What the reference worker needs to build the family's processors."""
    g, b = encoder.geometry, encoder.budget
    qwen = g.image_resize == "pil"
    settings = {"kind": "qwen" if qwen else "nemotron", "patch_size": g.patch_size,
                "merge_size": g.merge_size, "temporal_patch_size": g.temporal_patch_size,
                "image_mean": list(g.image_mean), "image_std": list(g.image_std)}
    if qwen:
        settings.update(min_pixels=b.min_pixels, max_pixels=b.max_pixels)
    else:
        settings.update(min_patches=b.min_pixels // g.patch_size ** 2,
                        max_patches=b.max_pixels // g.patch_size ** 2,
                        video_target_num_patches=g.video_target_num_patches)
    return settings


# ---- comparing pixels --------------------------------------------------------------------------


def as_rows(theirs: np.ndarray, ours: np.ndarray, geometry) -> np.ndarray:
    """A reference's output in the project's row layout: Nemotron-Omni's video processor gives
    (videos, tubelets, T*C, H, W); the project one row per tubelet patch (T, C, p, p)."""
    if theirs.ndim == 5:
        p, t = geometry.patch_size, geometry.temporal_patch_size
        _, tubelets, _, height, width = theirs.shape
        theirs = theirs.reshape(tubelets, t, 3, height // p, p, width // p, p)
        theirs = theirs.transpose(0, 3, 5, 1, 2, 4, 6).reshape(-1, ours.shape[-1])
    return theirs


def compare(theirs: np.ndarray, ours: np.ndarray) -> dict:
    if theirs.shape != ours.shape:
        return {"equal": False, "max_diff": None, "shape": list(theirs.shape)}
    diff = float(np.abs(theirs.astype(np.float64) - ours).max()) if ours.size else 0.0
    return {"equal": bool(np.array_equal(theirs, ours)), "max_diff": diff}


def merge(a: dict, b: dict) -> dict:
    if not a:
        return b
    if a["max_diff"] is None or b["max_diff"] is None:
        return {"equal": False, "max_diff": None, "shape": a.get("shape") or b.get("shape")}
    return {"equal": a["equal"] and b["equal"], "max_diff": max(a["max_diff"], b["max_diff"])}


# ---- one family x set --------------------------------------------------------------------------


def full_decode(images: list[bytes]) -> None:
    for data in images:
        Image.open(io.BytesIO(data)).load()


class OneCore:
    """Pins the bench's process and the reference worker (every thread of both) to one core a
    round, the core changing from round to round: the two take turns (one waits on the other's
    answer), so each round's paths all run on the same core and a core slowed by its neighbours
    (a VM's vCPUs share physical cores with other guests) slows every path of that round alike,
    not one process's paths in every round."""

    def __init__(self, pids: list[int]):
        self.pids = [os.getpid(), *pids]
        self.cores = sorted(os.sched_getaffinity(0))

    def pin(self, round_: int) -> None:
        self._allow({self.cores[round_ % len(self.cores)]})

    def release(self) -> None:
        self._allow(set(self.cores))

    def _allow(self, cores: set[int]) -> None:
        for pid in self.pids:
            for thread in os.listdir(f"/proc/{pid}/task"):
                try:
                    os.sched_setaffinity(int(thread), cores)
                except (ProcessLookupError, PermissionError):
                    pass  # a thread that ended meanwhile


def measure(paths: dict, count: int, rounds: int, cores: OneCore | None = None
            ) -> dict[str, list[float]]:
    """Per path, its CPU seconds per round summed over samples ``0..count-1``: one warm-up round,
    then ``rounds`` rounds, every sample running every path in turn, the order rotated each
    round, each round on one core (``cores``). Each path returns the CPU seconds of its call."""
    names = list(paths)
    totals = {name: [0.0] * rounds for name in names}
    for round_ in range(rounds + 1):
        if cores:
            cores.pin(round_)
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for i in range(count):
            for name in order:
                spent = paths[name](i)
                if round_:
                    totals[name][round_ - 1] += spent
    return totals


def local(fn):
    def timed(i):
        start = time.process_time()
        fn(i)
        return time.process_time() - start
    return timed


def remote(reference: Reference, request_of):
    def timed(i):
        answer = reference.ask(request_of(i))
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["cpu_s"]
    return timed


def run_set(encoder, reference, settings, name: str, samples: list, work: Path,
            rounds: int, pin: bool = True) -> dict:
    """One family x dataset: the project's path, the floor (images), every HF path."""
    video = name == "llava_video"
    kind = settings["kind"]
    prepared, files, requests = [], [], []
    for i, sample in enumerate(samples):
        if video:
            clip_name, data = sample
            s, parts = clip_sample(data)
            names = [work / f"{clip_name}.{s.media[0].format}"]
        else:
            s, parts = conversation_of(sample)
            names = [work / f"{name}_{i}_{k}.jpg" for k in range(len(sample))]
        for path, data in zip(names, sample[1:] if video else sample, strict=True):
            path.write_bytes(data)
        prepared.append((s, parts))
        files.append([str(p) for p in names])
    encoded = [ours_path(encoder, s, p) for s, p in prepared]
    for (_, plan), file_list in zip(encoded, files, strict=True):
        if video:
            media = plan.media[0]
            requests.append({"files": file_list, "video": {
                "frames": len(media.frame_indices), "indices": list(media.frame_indices),
                "size": [media.grid.resized_height, media.grid.resized_width]}})
        else:
            requests.append({"files": file_list, "targets": [
                [m.grid.resized_height, m.grid.resized_width] for m in plan.media]})
    paths = {"project": local(lambda i: ours_path(encoder, *prepared[i]))}
    if not video:
        paths["decode floor"] = local(lambda i: full_decode(samples[i]))
    pixels, errors = {}, {}
    hf_names = (VIDEO_PATHS if video else IMAGE_PATHS)[kind] if reference else ()
    for hf in hf_names:
        for (out, _), request in zip(encoded, requests, strict=True):
            save = work / "pixels.npy"
            answer = reference.ask({"op": "run", "path": hf, "family": settings, "save": str(save),
                                    **request})
            if "error" in answer:
                errors[hf] = answer["error"]
                break
            ours = (out.pixel_values_videos if video else out.pixel_values).numpy()
            theirs = as_rows(np.load(save), ours, encoder.geometry)
            pixels[hf] = merge(pixels.get(hf, {}), compare(theirs, ours))
        if hf not in errors:
            paths[hf] = remote(reference, lambda i, hf=hf: {
                "op": "run", "path": hf, "family": settings, "save": None, **requests[i]})
    cores = OneCore([reference.process.pid] if reference else []) if pin else None
    try:
        totals = measure(paths, len(samples), rounds, cores)
    finally:
        if cores:
            cores.release()
    n = len(samples)
    project = totals["project"]
    result = {"samples": n, "rounds": rounds, "errors": errors, "pixels": pixels,
              "tokens_per_sample": float(np.mean([len(o.input_ids) for o, _ in encoded])),
              "cpu_ms_per_sample": {k: 1000 * statistics.median(v) / n for k, v in totals.items()},
              "rounds_cpu_s": totals, "ratios": {}}
    for key, values in totals.items():
        if key != "project":
            per_round = [v / p for v, p in zip(values, project, strict=True)]
            result["ratios"][key] = {"median": statistics.median(per_round),
                                     "range": [min(per_round), max(per_round)]}
    if video:
        result["clips"] = [clip for clip, _ in samples]
        result["frames_per_sample"] = float(np.mean([len(p.media[0].frame_indices)
                                                     for _, p in encoded]))
    else:
        result["images_per_sample"] = float(np.mean([len(s) for s in samples]))
        result["source_mp_mean"] = float(np.mean([
            np.prod(Image.open(io.BytesIO(d)).size) / 1e6 for s in samples for d in s]))
    return result


# ---- the report --------------------------------------------------------------------------------


def pixel_note(entry: dict | None) -> str:
    if not entry:
        return "-"
    if entry["equal"]:
        return "bit-equal"
    if entry["max_diff"] is None:
        return f"other shape {tuple(entry['shape'])}"
    return f"max diff {entry['max_diff']:.3g}"


def table(results: dict) -> str:
    lines = ["| family | set | path | CPU ms / sample | samples / s / core | this path / project "
             "(median, range of rounds) | pixels vs the project |", "|---" * 7 + "|"]
    for family, sets in results.items():
        for name, r in sets.items():
            ms = r["cpu_ms_per_sample"]
            order = ["project", *sorted((k for k in ms if k != "project"), key=ms.get)]
            for key in order:
                ratio = r["ratios"].get(key)
                cell = ("-" if ratio is None else f"{ratio['median']:.2f}x "
                        f"({ratio['range'][0]:.2f}-{ratio['range'][1]:.2f})")
                who = "**project**" if key == "project" else key
                note = pixel_note(r["pixels"].get(key))
                lines.append(f"| {family} | {name} | {who} | {ms[key]:.1f} | "
                             f"{1000 / ms[key]:.2f} | {cell} | {note} |")
            for key, why in r["errors"].items():
                lines.append(f"| {family} | {name} | {key} | failed: {why} | | | |")
    return "\n".join(lines)


def summary(results: dict) -> str:
    """Per family x set: the fastest HF path, the project's ratio to it, and on image sets the
    project's fraction of time beyond the decode floor."""
    lines = ["| family | set | fastest HF path | its ratio to the project (median, range) | "
             "project over the decode floor | project's time that is the floor |",
             "|---|---|---|---|---|---|"]
    for family, sets in results.items():
        for name, r in sets.items():
            ms = r["cpu_ms_per_sample"]
            hf = [k for k in ms if k not in ("project", "decode floor")]
            floor = ms.get("decode floor")
            floor_cells = ("-", "-") if floor is None else (
                f"{ms['project'] / floor:.2f}x", f"{100 * floor / ms['project']:.0f} %")
            if not hf:
                lines.append(f"| {family} | {name} | not measured | - | {floor_cells[0]} | "
                             f"{floor_cells[1]} |")
                continue
            fastest = min(hf, key=ms.get)
            ratio = r["ratios"][fastest]
            lines.append(f"| {family} | {name} | {fastest} | {ratio['median']:.2f}x "
                         f"({ratio['range'][0]:.2f}-{ratio['range'][1]:.2f}) | "
                         f"{floor_cells[0]} | {floor_cells[1]} |")
    return "\n".join(lines)


def first_touch_ms(size: int = 64 << 20) -> tuple[float, float]:
    """CPU ms to write ``size`` bytes into fresh anonymous pages (their first touch: a page fault
    and the kernel's zeroing per page), then into the same pages again: what a path that
    allocates its buffers per call pays on this machine, against one that reuses them."""
    import mmap

    region = mmap.mmap(-1, size)
    view = np.frombuffer(region, np.uint8)
    start = time.process_time()
    view.fill(1)
    first = time.process_time()
    view.fill(2)
    again = time.process_time()
    del view
    region.close()
    return 1000 * (first - start), 1000 * (again - first)


def machine(reference_versions: dict | None, load: tuple, load_end: tuple) -> dict:
    import importlib.metadata

    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    project = {p: importlib.metadata.version(p) for p in ("torch", "pillow", "numpy", "av",
                                                          "transformers")}
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "project_venv": project, "resize": kernel(), "float_resize": float_kernel(),
            "reference_venv": reference_versions, "load_average_start": load,
            "load_average_end": load_end, "first_touch_64mb_ms": first_touch_ms()}


@click.command()
@click.option("--out", default="bench_out/loader_bench", type=click.Path(path_type=Path))
@click.option("--doc", default=None, type=click.Path(path_type=Path),
              help="write the markdown report here (docs/loader-benchmark.md)")
@click.option("--rounds", default=7, show_default=True)
@click.option("--quick", is_flag=True, help="fewer samples and clips, 2 rounds")
@click.option("--infer-venv", default=Path(".venv-infer"), type=click.Path(path_type=Path),
              show_default=True, help="make infer-venv's venv (torch + torchvision)")
@click.option("--families", multiple=True, type=click.Choice(FAMILIES))
@click.option("--sets", "only", multiple=True, type=click.Choice(SETS))
@click.option("--pin/--no-pin", default=True, show_default=True,
              help="both processes on one core a round, the core changing each round")
@click.option("--reference-keeps-memory", is_flag=True,
              help="the HF worker keeps freed pages as the project's loaders do (not what users "
                   "run: to see what the allocator is worth to the HF paths)")
def main(out: Path, doc: Path | None, rounds: int, quick: bool, infer_venv: Path,
         families: tuple, only: tuple, pin: bool, reference_keeps_memory: bool) -> None:
    """Time the loader against the Hugging Face paths (see the module docstring)."""
    from energon_tasks.tokenizer import build_test_tokenizer, load_tokenizer

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rounds = 2 if quick else rounds
    python, why = reference_python(infer_venv.resolve(), (out / "venv-ref").resolve())
    reference = versions = None
    if python is None:
        print(f"[bench-loader] {why}", file=sys.stderr)
    else:
        bundled = subprocess.run([str(python), "-c", "import av, pathlib; print(pathlib.Path("
                                  "av.__file__).resolve().parent.parent / 'av.libs')"],
                                 capture_output=True, text=True).stdout.strip()
        ffmpeg = link_pyav_ffmpeg(Path(bundled), out / "ffmpeg-libs") if bundled else None
        reference = Reference(python, ffmpeg)
        versions = reference.ask({"op": "versions"})
        if reference_keeps_memory and not reference.ask({"op": "keep_memory"})["kept"]:
            raise click.UsageError("the reference worker could not set its allocator (not glibc)")
    tokenizer_dir = Path(tempfile.mkdtemp()) / "tokenizer"
    build_test_tokenizer(tokenizer_dir)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    data = dict(image_sets(quick))
    data["llava_video"] = list(video_clips(out / "clips", quick).items())
    work = out / "media"
    work.mkdir(exist_ok=True)
    load = os.getloadavg()
    results = {}
    for family in families or FAMILIES:
        encoder = make_encoder(family, tokenizer)
        settings = family_settings(encoder)
        results[family] = {}
        for name in only or SETS:
            results[family][name] = run_set(encoder, reference, settings, name, data[name], work,
                                            rounds, pin)
            print(f"[bench-loader] {family} {name} {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
    if reference:
        reference.close()
    record = {"machine": machine(versions, load, os.getloadavg()), "rounds": rounds,
              "reference_keeps_memory": reference_keeps_memory,
              "quick": quick, "reference_missing": why or None, "results": results,
              "wall_s": time.perf_counter() - started,
              "command": " ".join(["python", *sys.argv])}
    (out / "loader_benchmark.json").write_text(json.dumps(record, indent=1))
    report = render(record)
    if doc:
        doc.write_text(report)
    print(summary(results))


def render(record: dict) -> str:
    """docs/loader-benchmark.md: how it was measured, on what, and the two tables."""
    m, results = record["machine"], record["results"]
    ref = m["reference_venv"]
    ref_line = (f"reference venv (`make infer-venv` + {', '.join(REFERENCE_PACKAGES[:4])}): "
                + ", ".join(f"{k} {v}" for k, v in ref.items() if v) if ref
                else f"reference: **not measured** ({record['reference_missing']})")
    project = ", ".join(f"{k} {v}" for k, v in m["project_venv"].items())
    load = "/".join(f"{v:.1f}" for v in m["load_average_start"])
    load_end = "/".join(f"{v:.1f}" for v in m["load_average_end"])
    touch = m.get("first_touch_64mb_ms")
    touch_line = "" if not touch else (
        f" Writing 64 MB into fresh pages took {touch[0]:.1f} ms here, into the same pages again"
        f"\n  {touch[1]:.1f} ms: where first touches cost less than here, the HF paths' times, "
        "and the ratios,\n  are lower.")
    reference_memory = (
        "**in this run the HF worker keeps them too**\n  (`--reference-keeps-memory`: not what "
        "users run)." if record.get("reference_keeps_memory") else
        "the HF paths run with glibc's defaults, as users run them, and\n  allocate their "
        "tensors per call.")
    clips = {name: FOREIGN.get(name) for name in VIDEO_CLIPS}
    clip_lines = "\n".join(
        f"  - `{name}`: " + ("the project's lookalike-style clip (`bench_task_encoder.make_video`: "
                             "30 s, libx264 veryfast CRF 23, keyframe every 2 s, B-frames)"
                             if spec is None else
                             f"{spec[3]} s, {spec[1]} in {spec[0]}, options {spec[2]}")
        for name, spec in clips.items())
    return f"""# Loader benchmark

Written by `make bench-loader` (`{record['command']}`); do not edit by hand: rerun it. The
discussion of these figures is in [benchmarks_task_encoder.md](benchmarks_task_encoder.md)
and [benchmarks.md](benchmarks.md).

## What was measured

The project's loader end to end per sample (`encode_sample`'s steps from the stored bytes:
decode, resize, normalise, patchify, tokens, labels, M-RoPE positions; the task encoder's
defaults, `image_decode: exact`, `seq_length` 16384) against every Hugging Face path users run
for the family, each on the same samples (`bench/loader_reference.py`):

- Qwen2.5-VL / Qwen3-VL images: qwen-vl-utils' `fetch_image` at the project's planned size,
  then transformers' image processor with its **torchvision** backend (the default wherever
  torchvision imports) or its **PIL** backend; and each processor **alone** on the opened image
  (it resizes itself within the family's pixel limits: what a script that skips qwen-vl-utils
  runs). The HF paths stop at `pixel_values` (no tokenisation); the project's figure includes its
  tokens, labels and positions.
- Nemotron-Omni images: `NemotronH_Omni_Reasoning_V3ImageProcessor` (torchvision backend) with
  the family's patch limits, one image a call.
- Videos: qwen-vl-utils' `fetch_video` with its **torchcodec** or **decord** reader (the
  project's frame count and size), then Qwen2-VL's / Qwen3-VL's video processor; Nemotron-Omni:
  torchcodec's or decord's frames at the project's frame indices, then its video processor.
  The HF readers read the clip from a file (qwen-vl-utils needs a path), the project from bytes.
- **decode floor** (image sets): the full JPEG decode of every image of the sample (PIL): no
  path that gives the processors' pixels can skip it.

Per core: one thread, process CPU time (`time.process_time` in the process that runs the path:
this one for the project, the reference worker for the HF paths). One warm-up round, then
{record['rounds']} rounds; in each round every sample runs every path in turn, the order rotated
each round, and both processes are pinned to one core, the next core each round (on a VM a core
can be slowed by its neighbours for minutes: pinned, that slows every path of its rounds alike,
not one process's paths). CPU ms per sample: the median over rounds; **ratios: the median of
the per-round ratio (HF path / project) and its range over the rounds**. Pixels: each HF path's
`pixel_values` (`pixel_values_videos`) against the project's: bit-equal, or the largest
difference in normalised units (1 grey level is about 0.015 with the CLIP std, 0.008 with
Qwen3-VL's 0.5). Families: Qwen2.5-VL, Qwen3-VL and Nemotron-Omni (dynamic), the three image
processors the project reproduces; Qwen3-VL MoE and Qwen3.5 read Qwen3-VL's processor (the same
path), and tiled Nemotron-Omni resizes with PIL's bicubic on uint8, the Qwen path's kernel.

Sets (generated; sizes as on the hub): Mantis-like samples of 10 photo JPEGs (q90; the task
encoder's default `max_num_images`) of 400-900 px a side; InfoVQA-like text pages (q90)
800-1400 x 1400-3200 (the dataset's median is ~2 MP), 1500-2500 x 4000-6000, and one 6000x9000
page; LLaVA-Video-like 640x360 30 fps clips:
{clip_lines}

## Machine

- {m['cpu']}, {m['cores']} cores: load average {load} (1/5/15 min) at the start, {load_end} at
  the end (the bench keeps about one core busy itself: a higher load means other jobs ran).
  Process CPU time does not count other jobs' time, but they share the caches and memory
  bandwidth, so the rounds spread; the ratio ranges show by how much.
- The project's process keeps the pages of freed pixel buffers (`energon_tasks.pixel_memory`,
  as every loader process does); {reference_memory}{touch_line}
- project venv: Python {m['python']}, {project}; resize kernels: uint8 `{m['resize']}`;
  float32 `{m['float_resize']}`.
- {ref_line}.
- {record['rounds']} rounds{' (--quick)' if record['quick'] else ''}, {record['wall_s'] / 60:.1f}
  min wall.

## Per family and set: the fastest HF path

{summary(results)}

## Every path

{table(results)}
"""


if __name__ == "__main__":
    main()
