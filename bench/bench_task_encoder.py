"""Per-core throughput of the Qwen-VL task encoder next to the reference path and the floor.

One process, one run, everything timed on the same machine (single-threaded numpy/torch):

1. InfoVQA-like high-resolution JPEGs (1500x4000 .. 2500x6000, quality 90), per image:
   (a) reference: qwen-vl-utils ``fetch_image`` steps reproduced here (qwen-vl-utils does not import
       on our CPU machines: open, RGB with alpha on white, ``smart_resize`` factor 28, PIL resize)
       followed by transformers' ``Qwen2VLImageProcessorPil`` (min_pixels 200704, max_pixels
       1003520) -> ``pixel_values``;
   (b) ours: the task encoder's public steps end to end on a one-image conversation
       (``tokenize_turns`` -> ``plan_sample`` -> ``decode_media`` -> ``assemble``: decode at the
       planned size, ``--image-decode`` exact (default) or fast (JPEG draft), normalise, patchify,
       tokens, labels, M-RoPE positions);
   (c) floor: PIL decode at the needed DCT scale (``draft``) + resize to the target + float32
       normalise only (no patchify, no tokens).
2. Mantis-like samples of 12 images (400..900 px a side), per sample, the same three paths.
3. Video: a 60 s 640x360 H.264 clip, keyframe every 2 s and every 0.5 s: 16 frames with
   ``decode_video_frames`` (seek / decode forward to the chosen frames only, non-reference frames
   before a pick skipped) against decoding every frame and keeping the same 16; also the number
   of frames a decoder restarting at the keyframe before each pick needs (the old bound).
4. Packing: the real loader (``get_train_loader``, 0 workers) over a Mantis lookalike converted with
   ``python -m converters mantis``: share of non-pad tokens over N batches, packing on and off.
5. Memory per worker: peak RSS of a fresh spawned process that runs (b) over the images of 1 and 2
   (what one loader worker holds), and the bytes of one batch's tensors.

Each timing: one warm-up, then REPEATS rounds in which the compared paths run one after the
other (so load changes on a shared machine hit them alike), median per path; wall-clock and
process CPU time are both recorded.

Usage: python bench/bench_task_encoder.py --out bench_out/te [--quick]
Writes <out>/task_encoder.json and prints a markdown table (copied into
docs/benchmarks_task_encoder.md).
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Per-core numbers: keep BLAS / torch / OpenMP to one thread (must happen before numpy / torch).
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import click  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lookalikes.media import encode_h264, photo_jpeg  # noqa: E402

MIN_PIXELS, MAX_PIXELS = 200704, 1003520  # Megatron-Bridge defaults (256 / 1280 * 28**2)
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
REPEATS = 5


# ---- data ------------------------------------------------------------------------------------


def document_jpeg(rng: np.random.Generator, width: int, height: int) -> bytes:
    """InfoVQA-like page: smooth colour blocks + grain + dark text-like strokes, JPEG q90."""
    base = rng.integers(60, 255, (height // 64 + 2, width // 64 + 2, 3), dtype=np.uint8)
    image = Image.fromarray(base).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(height // 12):  # "text lines": runs of short dark boxes
        y = int(rng.integers(0, height - 20))
        x = int(rng.integers(0, width // 2))
        for _ in range(int(rng.integers(5, 25))):
            w = int(rng.integers(6, 30))
            draw.rectangle([x, y, x + w, y + int(rng.integers(8, 16))],
                           fill=tuple(int(v) for v in rng.integers(0, 80, 3)))
            x += w + int(rng.integers(4, 10))
    array = np.asarray(image, dtype=np.int16)
    array += rng.integers(-8, 8, (1, width, 3), dtype=np.int16)  # cheap column grain
    array += rng.integers(-8, 8, (height, 1, 3), dtype=np.int16)
    buffer = io.BytesIO()
    Image.fromarray(array.clip(0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def make_video(seconds: int, fps: int, width: int, height: int, gop: int) -> bytes:
    """H.264 mp4 of a textured scene panning and zooming, plus grain: decoding costs as real."""
    rng = np.random.default_rng(7)
    field = rng.integers(0, 255, (height // 8 + 40, width // 8 + 80, 3), dtype=np.uint8)
    texture = np.asarray(Image.fromarray(field).resize((width * 2, height * 2), Image.BICUBIC))
    grain = rng.integers(-10, 10, (8, height, width, 3), dtype=np.int16)

    def frames():
        for i in range(seconds * fps):
            x = int((width / 2) * (0.5 + 0.5 * np.sin(i / 40)))
            y = int((height / 2) * (0.5 + 0.5 * np.cos(i / 55)))
            frame = texture[y:y + height, x:x + width].astype(np.int16) + grain[i % 8]
            yield frame.clip(0, 255).astype(np.uint8)

    return encode_h264(frames(), width=width, height=height, fps=fps,
                       options={"g": str(gop), "keyint_min": str(gop), "sc_threshold": "0",
                                "preset": "veryfast", "crf": "23"})


# ---- the three image paths --------------------------------------------------------------------


def reference_fetch_image(data: bytes):
    """qwen-vl-utils ``fetch_image`` steps: open, RGB (alpha on white), smart_resize(28), resize."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    image = Image.open(io.BytesIO(data))
    if image.mode == "RGBA":
        white = Image.new("RGB", image.size, (255, 255, 255))
        white.paste(image, mask=image.split()[3])
        image = white
    else:
        image = image.convert("RGB")
    height, width = smart_resize(image.height, image.width, factor=28,
                                 min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return image.resize((width, height))


def make_reference_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def reference_path(processor, images: list[bytes]):
    fetched = [reference_fetch_image(data) for data in images]
    out = processor(images=fetched, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def floor_path(images: list[bytes], sizes: list[tuple[int, int]]) -> list[np.ndarray]:
    """Decode at the needed DCT scale + resize to the target + float32 normalise; nothing else."""
    out = []
    for data, (height, width) in zip(images, sizes, strict=True):
        image = Image.open(io.BytesIO(data))
        image.draft("RGB", (width, height))
        image = image.convert("RGB")
        if image.size != (width, height):
            image = image.resize((width, height), Image.BICUBIC)
        array = np.asarray(image, dtype=np.float32)
        out.append((array * np.float32(1 / 255) - CLIP_MEAN) / CLIP_STD)
    return out


def conversation_of(images: list[bytes]):
    """A canonical one-turn conversation whose user turn holds every image (JPEG)."""
    from energon_tasks.sample_format import CanonicalSample, Media, SourceRef, Turn

    media = []
    for i, data in enumerate(images):
        width, height = Image.open(io.BytesIO(data)).size
        media.append(Media(part=f"img{i}.jpg", kind="image", format="jpeg", width=width,
                           height=height, bytes=len(data)))
    sample = CanonicalSample(
        dataset="bench", source=SourceRef(config="bench", split="train", ids=["x"], rows=[0]),
        conversation=[Turn(role="user", content="<image>" * len(images) + " What is shown?"),
                      Turn(role="assistant", content="The answer is 42 percent.")],
        media=media)
    return sample, {f"img{i}.jpg": data for i, data in enumerate(images)}


def ours_path(encoder, sample, parts, key: str = "bench"):
    """The task encoder's public steps, as ``encode_sample`` runs them."""
    turns = encoder.tokenize_turns(sample)
    plan = encoder.plan_sample(sample, key, turns)
    if plan.skip:
        raise RuntimeError(f"bench sample skipped by the budget: {plan.detail}")
    pixels = encoder.decode_media(plan, sample, parts)
    base = {"__key__": key, "__restore_key__": (), "__subflavors__": {}, "__sources__": ()}
    return encoder.assemble(sample, plan, turns, pixels, base), plan


def make_encoder(tokenizer_dir: str, **fields):
    from energon_tasks.config import TaskEncoderConfig
    from energon_tasks.task_encoder import VLMTaskEncoder
    from energon_tasks.tokenizer import load_tokenizer

    config = TaskEncoderConfig(model="qwen2.5-vl", min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                               **fields)
    return VLMTaskEncoder(config, tokenizer=load_tokenizer(tokenizer_dir))


# ---- timing -----------------------------------------------------------------------------------


def timed_together(fns: dict, repeats: int = REPEATS) -> tuple[dict, dict]:
    """Median wall and CPU seconds of each ``fns[name]()``: one warm-up each, then ``repeats``
    rounds that run every path once, in turn (interleaved against drifting machine load)."""
    for fn in fns.values():
        fn()
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return ({k: statistics.median(v) for k, v in wall.items()},
            {k: statistics.median(v) for k, v in cpu.items()})


def image_section(encoder, processor, samples: list[list[bytes]], repeats: int) -> dict:
    """Three paths over ``samples`` (each a list of image bytes); totals per path."""
    prepared = [conversation_of(images) for images in samples]
    plans = [ours_path(encoder, sample, parts)[1] for sample, parts in prepared]
    sizes = [[(m.grid.resized_height, m.grid.resized_width) for m in plan.media] for plan in plans]
    tokens = sum(m.grid.visual_tokens for plan in plans for m in plan.media)

    # correctness: our pixel rows and grids equal the reference's shape, values close
    ours0, _ = ours_path(encoder, *prepared[0])
    ref_pixels, ref_grid = reference_path(processor, samples[0])
    if tuple(ours0.pixel_values.shape) != tuple(ref_pixels.shape) or not bool(
            (ours0.image_grid_thw == ref_grid).all()):
        raise RuntimeError(f"shape mismatch: ours {tuple(ours0.pixel_values.shape)} "
                           f"vs reference {tuple(ref_pixels.shape)}")
    mean_abs_diff = float((ours0.pixel_values - ref_pixels.float()).abs().mean())

    seconds, cpu_seconds = timed_together({
        "reference": lambda: [reference_path(processor, images) for images in samples],
        "ours": lambda: [ours_path(encoder, s, p) for s, p in prepared],
        "ours_decode_media_only": lambda: [
            encoder.decode_media(plan, s, p) for plan, (s, p) in zip(plans, prepared, strict=True)],
        "floor": lambda: [floor_path(images, size)
                          for images, size in zip(samples, sizes, strict=True)],
    }, repeats)
    n = len(samples)
    return {
        "samples": n,
        "images": sum(map(len, samples)),
        "visual_tokens": tokens,
        "source_pixels_mean": float(np.mean([Image.open(io.BytesIO(d)).size[0]
                                             * Image.open(io.BytesIO(d)).size[1]
                                             for images in samples for d in images])),
        "mean_abs_pixel_diff_vs_reference": mean_abs_diff,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "ours_assemble_share": 1 - seconds["ours_decode_media_only"] / seconds["ours"],
        "samples_per_s": {k: n / v for k, v in seconds.items()},
        "visual_tokens_per_s": {k: tokens / v for k, v in seconds.items()},
        "ours_speedup_vs_reference": seconds["reference"] / seconds["ours"],
        "ours_time_vs_floor": seconds["ours"] / seconds["floor"],
        "ours_cpu_speedup_vs_reference": cpu_seconds["reference"] / cpu_seconds["ours"],
        "ours_cpu_vs_floor": cpu_seconds["ours"] / cpu_seconds["floor"],
        "pixel_values_bytes_per_sample": int(ours0.pixel_values.numel() * 4),
        "uint8_bytes_per_sample": int(sum(h * w * 3 for h, w in sizes[0])),
    }


def keyframe_restart_frames(data: bytes, picks: list[int]) -> int:
    """Frames a decoder needs that restarts at the keyframe before each pick (no skipping)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        packets = sorted((p.pts, p.is_keyframe) for p in container.demux(stream)
                         if p.pts is not None)  # display order
    keys = [index for index, (_, is_key) in enumerate(packets) if is_key]
    needed, position = 0, -1
    for pick in picks:
        key = max(k for k in keys if k <= pick)
        needed += pick - key + 1 if key > position else pick - position
        position = pick
    return needed


def video_section(repeats: int, gop_seconds: float) -> dict:
    import av

    from energon_tasks.video_decode import decode_video_frames, video_frame_pixels

    fps, seconds, width, height = 30, 60, 640, 360
    gop = round(gop_seconds * fps)
    start = time.perf_counter()
    data = make_video(seconds, fps, width, height, gop)
    encode_s = time.perf_counter() - start
    with av.open(io.BytesIO(data)) as container:
        total = container.streams.video[0].frames or seconds * fps
    picks = np.linspace(0, total - 1, 16).round().astype(int).tolist()
    size = (height // 28 * 28, width // 28 * 28)  # 336 x 616, as smart_resize(360, 640)

    def ours(thread_type=None):
        return decode_video_frames(data, picks, size=size, max_source_pixels=89_478_485,
                                   thread_type=thread_type)

    def decode_all(thread_type=None):
        wanted, kept = set(picks), []
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            if thread_type is not None:
                stream.thread_type = thread_type
            for index, frame in enumerate(container.decode(stream)):
                if index in wanted:  # the same conversion + resize as ours
                    kept.append(video_frame_pixels(frame, (size[1], size[0])))
        return kept

    def convert_only():  # the 16 frame conversions + resizes both paths pay
        with av.open(io.BytesIO(data)) as container:
            frame = next(container.decode(video=0))
            for _ in picks:
                video_frame_pixels(frame, (size[1], size[0]))

    result = ours()
    all_frames = decode_all()
    same = all(np.array_equal(a, b) for a, b in zip(result.frames, all_frames, strict=True))
    threaded = ours("AUTO")
    same_threaded = all(np.array_equal(a, b)
                        for a, b in zip(threaded.frames, all_frames, strict=True))
    wall, cpu = timed_together({
        "ours_seek": ours, "decode_all": decode_all, "convert_16": convert_only,
        "ours_seek_threads_auto": lambda: ours("AUTO"),
        "decode_all_threads_auto": lambda: decode_all("AUTO"),
    }, repeats)
    restart = keyframe_restart_frames(data, picks)
    return {
        "clip": f"{seconds} s {width}x{height} H.264 {fps} fps, keyframe every {gop} frames "
                f"({gop / fps:g} s), libx264 veryfast crf 23 (3 B-frames)",
        "keyframe_interval_s": gop / fps,
        "frames_total": total, "frames_sampled": len(picks), "bytes": len(data),
        "encode_s": encode_s,
        "ours_decoded_frames": result.decoded_frames, "ours_seeks": result.seeks,
        "keyframe_restart_frames": restart,
        "frames_identical_to_decode_all": same,
        "frames_identical_threads_auto": same_threaded,
        "seconds": wall,
        "cpu_seconds": cpu,
        "speedup": wall["decode_all"] / wall["ours_seek"],
        "cpu_speedup": cpu["decode_all"] / cpu["ours_seek"],
        "speedup_threads_auto": wall["decode_all_threads_auto"] / wall["ours_seek_threads_auto"],
        "bound_keyframe_restart": total / restart,
        # decode-all split into (1800 decodes) + (16 conversions): a keyframe-restart reader
        # decodes restart / total of the first part and pays the whole second part
        "bound_keyframe_restart_with_conversion": wall["decode_all"] / (
            (wall["decode_all"] - wall["convert_16"]) * restart / total + wall["convert_16"]),
    }


def packing_section(tokenizer_dir: str, batches: int, work: Path) -> dict:
    from energon_tasks.loader import get_train_loader
    from lookalikes.mantis import build_mantis

    build_mantis(work / "src", configs={"llava_665k_multi": 40, "nlvr2": 40,
                                        "birds-to-words": 40}, pitfalls=False)
    dataset = work / "dataset"
    subprocess.run([sys.executable, "-m", "converters", "mantis", "--source",
                    str(work / "src" / "Mantis-Instruct"), "--out", str(dataset)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = {}
    for packing in (True, False):
        encoder = make_encoder(tokenizer_dir, seq_length=4096, packing=packing)  # buffer 64
        loader = get_train_loader(dataset / "metadataset.yaml", task_encoder=encoder,
                                  batch_size=2 if packing else 4, num_workers=0,
                                  shuffle_buffer_size=64, max_samples_per_sequence=20)
        real = total = samples = 0
        batch_bytes, row_lengths, start = [], [], time.perf_counter()
        for _, batch in zip(range(batches), loader):
            real += int(batch.attention_mask.sum())
            total += batch.input_ids.numel()
            row_lengths += batch.attention_mask.sum(dim=1).tolist()
            samples += (len(batch.cu_seqlens) - 1) if packing else len(batch.__key__)
            batch_bytes.append(sum(
                getattr(batch, name).numel() * getattr(batch, name).element_size()
                for name in ("input_ids", "labels", "loss_mask", "attention_mask",
                             "position_ids", "pixel_values", "image_grid_thw",
                             "pixel_values_videos", "video_grid_thw", "cu_seqlens")
                if getattr(batch, name) is not None))
        out["packed" if packing else "unpacked"] = {
            "batches": batches, "rows_per_batch": 2 if packing else 4,
            "seq_length": 4096, "non_pad_share": real / total, "tokens_total": total,
            # share of non-pad tokens if every row were padded to seq_length (fixed_length)
            "fill_of_seq_length": real / (len(row_lengths) * 4096),
            "row_tokens_min_median_max": [min(row_lengths), statistics.median(row_lengths),
                                          max(row_lengths)],
            "samples": samples, "seconds": time.perf_counter() - start,
            "batch_tensor_bytes_median": int(statistics.median(batch_bytes)),
        }
        del loader
    return out


# ---- memory of one worker -----------------------------------------------------------------


def _memory_worker(tokenizer_dir: str, image_dir: str, queue) -> None:
    """Spawned child: what one loader worker holds while encoding the image sections."""
    import threading

    import psutil

    encoder = make_encoder(tokenizer_dir, max_num_images=16, seq_length=16384)
    process = psutil.Process()
    baseline = process.memory_info().rss
    peak, stop = [baseline], threading.Event()

    def sample_rss() -> None:  # current RSS every 2 ms (ru_maxrss also counts import spikes)
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    thread = threading.Thread(target=sample_rss, daemon=True)
    thread.start()
    result = {}
    for name in ("infovqa", "mantis"):
        groups = json.loads((Path(image_dir) / f"{name}.json").read_text())
        for files in groups:
            images = [(Path(image_dir) / f).read_bytes() for f in files]
            encoded, _ = ours_path(encoder, *conversation_of(images))
            del encoded
        result[f"peak_rss_after_{name}"] = peak[0]
    stop.set()
    thread.join()
    result.update(rss_after_imports=baseline,
                  ru_maxrss_whole_process=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    queue.put(result)


def memory_section(tokenizer_dir: str, image_dir: Path) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_memory_worker, args=(tokenizer_dir, str(image_dir), queue))
    process.start()
    result = queue.get(timeout=300)
    process.join()
    return result


# ---- CLI --------------------------------------------------------------------------------------


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def table(result: dict) -> str:
    lines = ["| case | reference | ours | floor | ours / reference | ours time / floor time |",
             "|---|---|---|---|---|---|"]
    for name, label in (("infovqa", "InfoVQA-like, 1 image/sample"),
                        ("mantis", "Mantis-like, 12 images/sample")):
        s = result[name]
        cells = [f"{s['samples_per_s'][k]:.2f} samples/s, {s['visual_tokens_per_s'][k]:,.0f} tok/s"
                 for k in ("reference", "ours", "floor")]
        lines.append(f"| {label} | {' | '.join(cells)} | {s['ours_speedup_vs_reference']:.2f}x "
                     f"(CPU {s['ours_cpu_speedup_vs_reference']:.2f}x; target >= 4x) | "
                     f"{s['ours_time_vs_floor']:.2f}x (CPU {s['ours_cpu_vs_floor']:.2f}x; "
                     f"target <= 1.3x) |")
    for v in result["videos"]:
        lines.append(
            f"| video 16 of {v['frames_total']} frames, keyframe {v['keyframe_interval_s']:g} s"
            f" | decode all {v['seconds']['decode_all'] * 1000:.0f} ms | ours "
            f"{v['seconds']['ours_seek'] * 1000:.0f} ms ({v['ours_decoded_frames']} frames "
            f"decoded, {v['ours_seeks']} seeks; keyframe restart needs "
            f"{v['keyframe_restart_frames']}) | - | {v['speedup']:.2f}x (CPU "
            f"{v['cpu_speedup']:.2f}x; target >= 5x; keyframe-restart bound "
            f"{v['bound_keyframe_restart']:.1f}x frames, "
            f"{v['bound_keyframe_restart_with_conversion']:.1f}x with the 16 conversions) | - |")
        lines.append(
            f"| same, codec threads AUTO (2 cores, shared) | decode all "
            f"{v['seconds']['decode_all_threads_auto'] * 1000:.0f} ms | ours "
            f"{v['seconds']['ours_seek_threads_auto'] * 1000:.0f} ms | - | "
            f"{v['speedup_threads_auto']:.2f}x | - |")
    p = result["packing"]
    lo, mid, hi = p["packed"]["row_tokens_min_median_max"]
    lines.append(f"| non-pad tokens, {p['packed']['batches']} batches, seq 4096 | unpacked "
                 f"{100 * p['unpacked']['non_pad_share']:.1f} % | packed "
                 f"{100 * p['packed']['non_pad_share']:.1f} % (rows {lo}/{mid:.0f}/{hi} tokens "
                 f"min/median/max; {100 * p['packed']['fill_of_seq_length']:.1f} % of "
                 f"seq_length) | - | target >= 95 % | - |")
    m = result["memory"]
    lines.append(f"| memory, one spawned worker (RSS sampled every 2 ms) | after imports "
                 f"{mib(m['rss_after_imports'])} | peak {mib(m['peak_rss_after_infovqa'])} "
                 f"(InfoVQA) / {mib(m['peak_rss_after_mantis'])} (+Mantis) | - | "
                 f"ru_maxrss {mib(m['ru_maxrss_whole_process'])} (incl. import spike) | - |")
    for name in ("infovqa", "mantis"):
        s = result[name]
        lines.append(f"| ours split, {name} | - | assemble (normalise, patchify, tokens, M-RoPE) "
                     f"{100 * s['ours_assemble_share']:.0f} % of ours | - | - | - |")
    info, mantis = result["infovqa"], result["mantis"]
    lines.append(f"| bytes per sample | uint8 {mib(info['uint8_bytes_per_sample'])} "
                 f"(InfoVQA) | pixel_values {mib(info['pixel_values_bytes_per_sample'])}"
                 f" (InfoVQA), {mib(mantis['pixel_values_bytes_per_sample'])} (Mantis) | "
                 f"- | packed batch {mib(p['packed']['batch_tensor_bytes_median'])} | - |")
    return "\n".join(lines)


@click.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_out/te"),
              show_default=True)
@click.option("--quick", is_flag=True, help="Fewer images / samples / batches (under 1 minute).")
@click.option("--image-decode", type=click.Choice(["exact", "fast"]), default="exact",
              show_default=True, help="task_encoder.image_decode of 'ours' (the figures in "
              "docs/benchmarks_task_encoder.md's throughput section were measured with fast).")
def main(out: Path, quick: bool, image_decode: str) -> None:
    """Run every section once and write <out>/task_encoder.json."""
    import torch

    torch.set_num_threads(1)
    from energon_tasks.tokenizer import build_test_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    wall = time.perf_counter()
    rng = np.random.default_rng(0)
    repeats = 1 if quick else REPEATS
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokenizer_dir = str(build_test_tokenizer(work / "tokenizer"))
        image_dir = work / "images"
        image_dir.mkdir()
        n_info = 3 if quick else 12
        info = []
        for _ in range(n_info):
            width = int(rng.integers(1500, 2501))
            height = int(rng.integers(4000, 6001))
            info.append([document_jpeg(rng, width, height)])
        n_mantis = 2 if quick else 10
        mantis = [[photo_jpeg(rng, int(rng.integers(400, 901)), int(rng.integers(400, 901)))
                   for _ in range(12)] for _ in range(n_mantis)]
        for name, groups in (("infovqa", info), ("mantis", mantis)):
            names = []
            for s, images in enumerate(groups):
                names.append([])
                for i, data in enumerate(images):
                    (image_dir / f"{name}_{s}_{i}.jpg").write_bytes(data)
                    names[-1].append(f"{name}_{s}_{i}.jpg")
            (image_dir / f"{name}.json").write_text(json.dumps(names))
        print(f"data generated in {time.perf_counter() - wall:.1f} s", file=sys.stderr)

        encoder = make_encoder(tokenizer_dir, max_num_images=16, seq_length=16384,
                               image_decode=image_decode)
        processor = make_reference_processor()
        result = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform(), "threads": 1,
                        "load_average_at_start": os.getloadavg()},
            "quick": quick, "repeats": repeats,
            "settings": {"model": "qwen2.5-vl", "min_pixels": MIN_PIXELS,
                         "max_pixels": MAX_PIXELS, "image_decode": image_decode},
        }
        result["infovqa"] = image_section(encoder, processor, info, repeats)
        print(f"infovqa done {time.perf_counter() - wall:.1f} s", file=sys.stderr)
        result["mantis"] = image_section(encoder, processor, mantis, repeats)
        print(f"mantis done {time.perf_counter() - wall:.1f} s", file=sys.stderr)
        result["videos"] = [video_section(repeats, gop_seconds) for gop_seconds in (2.0, 0.5)]
        print(f"video done {time.perf_counter() - wall:.1f} s", file=sys.stderr)
        result["packing"] = packing_section(tokenizer_dir, 10 if quick else 30, work / "packing")
        print(f"packing done {time.perf_counter() - wall:.1f} s", file=sys.stderr)
        result["memory"] = memory_section(tokenizer_dir, image_dir)
    result["wall_s"] = time.perf_counter() - wall
    result["machine"]["load_average_at_end"] = os.getloadavg()  # 1, 5, 15 min: shared machine
    result["table"] = table(result)
    (out / "task_encoder.json").write_text(json.dumps(result, indent=1))
    print(result["table"])
    print(f"\nwall {result['wall_s']:.0f} s; written {out / 'task_encoder.json'}")


if __name__ == "__main__":
    main()
