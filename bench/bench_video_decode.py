"""Video frame reading at the decoder's limit: the project's reader side by side with the others.

Per clip and frame count (uniform over the whole clip, ``np.linspace(0, n - 1, k)``: the
project reads these positions by time as the loader does, the others their rounded indices), in
one process, one decode thread each, process CPU time, interleaved rounds (every reader once per
round, in turn; median over rounds after a warm-up), each pick resized to 336x616 (PIL bicubic
after FFmpeg's rgb24, the loader's conversion):

- ``project``: ``energon_tasks.video_decode.decode_video_at`` (the loader's read: the frames
  shown at the positions' times, from the packets' pts; planned reads, exact);
- ``decode_all``: PyAV decoding every frame in order, converting the picks only;
- ``torchcodec``: ``VideoDecoder(seek_mode="exact").get_frames_at`` (torchcodec 0.17);
- ``decord``: ``VideoReader.get_batch`` (decord 0.6);
- ``keyframe``: the project with ``sampling="keyframe"`` (the keyframe nearest each pick; a
  keyframe two picks share is decoded and converted once), checked against a sequential decode:
  the nearest keyframe to each pick, its pixels and its true timestamp (``keyframe_check``);
- ``bound``: the exact-reader CPU bound, computed in the same run: the decode CPU of just the
  packets an exact reader must decode (from each pick's keyframe, GOPs shared between nearby
  picks; the keyframe and the reference frames up to the pick, and the pick: the H.264 NAL
  headers' ``nal_ref_idc`` says which frames others reference), each packet's CPU measured in
  a single-thread sequential decode of the clip, plus the picks' conversions. ``bound /
  project`` is the median over rounds of the per-round ratio, with the rounds' range, and the
  ratio of the two's least rounds (a shared machine only adds CPU time to either).

Readers that are not installed (``pip install -e .[bench]``) or that cannot load are listed as
such, with the reason, never timed with something else. The torchcodec wheel on PyPI links
CUDA's libraries (``libtorch_cuda.so``, ``libcudart``), which a CPU-only torch does not have: run
the bench with a venv that holds a CUDA build of torch (it imports and decodes on a machine
without a GPU), torchcodec, av, numpy, pillow, click, pyyaml and decord, with this checkout on
``PYTHONPATH`` (docs/benchmarks.md). The frames each reader returns are compared with
decode_all's (``equal``). The report names the interpreter, torch, torchcodec, decord and the
FFmpeg each reader decodes with.

torchcodec and PyAV decode with the same FFmpeg: torchcodec links FFmpeg's shared libraries by
their plain names (``libavcodec.so.62``), PyAV's wheel bundles them under hashed names; the bench
links PyAV's under the plain names into ``<out>/ffmpeg-libs`` and re-runs itself once with that
folder on ``LD_LIBRARY_PATH`` (``--system-ffmpeg``: use the system's FFmpeg instead). PyAV is
imported before torch (torchcodec's metadata op returns a tuple, not its JSON string, the other
way round).

Clips (generated with PyAV, cached in ``--cache``): 640x360 30 fps x264 (veryfast, CRF 23,
3 B-frames, pyramid) of a panned textured scene with moving shapes, 60 s, keyframe every 2, 5 or
10 s; and 854x480 30 fps, 180 s, keyframe every 5 s.

Usage: [PYTHONPATH=.] python bench/bench_video_decode.py --out bench_out/video_decode [--rounds 9]
       [--quick] [--clips 360p_60s_gop5 ...]
Writes <out>/video_decode.json and prints the markdown table of docs/benchmarks.md.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import re
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import av  # noqa: E402
import click  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from energon_tasks.resize import kernel, resize_rgb  # noqa: E402
from energon_tasks.video_decode import decode_video_at, video_frame_pixels  # noqa: E402

SIZE = (336, 616)  #: (height, width) every pick is resized to
#: name -> (width, height, seconds, GOP seconds)
CLIPS = {"360p_60s_gop2": (640, 360, 60, 2), "360p_60s_gop5": (640, 360, 60, 5),
         "360p_60s_gop10": (640, 360, 60, 10), "480p_180s_gop5": (854, 480, 180, 5)}
FPS = 30
PICKS = (16, 64)


def make_clip(width: int, height: int, seconds: int, gop: int, fps: int = FPS) -> bytes:
    """A camera pan over a smooth texture with three moving rectangles (x264, B-frames)."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (height // 16 + 2, 3 * width // 16 + 2, 3), dtype=np.uint8)
    from PIL import Image

    texture = np.asarray(Image.fromarray(base).resize((3 * width + 32, height + 32),
                                                      Image.BICUBIC))
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "veryfast", "crf": "23", "x264-params":
                          f"keyint={gop * fps}:min-keyint={gop * fps}:scenecut=0:bframes=3"}
        for i in range(seconds * fps):
            x = int(i * 2 * width / (seconds * fps))
            frame = texture[(i // 7) % 16:][:height, x:x + width].copy()
            for k, colour in enumerate(((230, 40, 40), (40, 200, 60), (40, 60, 220))):
                cx = int((0.5 + 0.4 * np.sin(i / (20 + 7 * k) + k)) * (width - 60))
                cy = int((0.5 + 0.4 * np.cos(i / (25 + 5 * k) + 2 * k)) * (height - 60))
                frame[cy:cy + 50, cx:cx + 50] = colour
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    return buffer.getvalue()


#: Clips made with other content and other encoder settings than ``make_clip``'s (and than
#: ``lookalikes.media``'s): name -> (container format, codec, stream options, seconds).
#: Handheld jitter over three scenes of fine detail, cut every 6 s, with a fade; 640x360 30 fps.
#: x264 at its own defaults (keyframe every 250 frames at most, scene-cut keyframes, adaptive
#: B-frames), x264 slow with a fixed 2 s GOP and 5 B-frames, VP9 (libvpx, 4 s GOP), MPEG-4 part 2
#: in AVI (2 B-frames).
FOREIGN = {
    "x264_defaults_film": ("mp4", "libx264", {"preset": "medium", "tune": "film", "crf": "21"}, 40),
    "x264_slow_gop2_b5": ("mp4", "libx264", {"preset": "slow", "crf": "20", "x264-params":
                          "keyint=60:min-keyint=60:scenecut=0:bframes=5:b-pyramid=normal:ref=5"},
                          40),
    "vp9_gop4": ("webm", "libvpx-vp9", {"crf": "33", "b": "0", "g": "120", "deadline": "realtime",
                                        "cpu-used": "8", "row-mt": "0"}, 40),
    "mpeg4_avi_b2": ("avi", "mpeg4", {"qscale": "4", "g": "60", "bf": "2"}, 40),
}


def foreign_clip(name: str, width: int = 640, height: int = 360, fps: int = FPS) -> bytes:
    """A clip of ``FOREIGN[name]``: other content, other encoder (see ``FOREIGN``)."""
    fmt, codec, options, seconds = FOREIGN[name]
    rng = np.random.default_rng(11)
    from PIL import Image, ImageDraw

    scenes = []
    for k in range(3):  # fine detail: text-like strokes over a noisy gradient
        scene = Image.fromarray(rng.integers(0, 256, (height // 4 + 20, width // 4 + 20, 3),
                                             dtype=np.uint8)).resize((width + 80, height + 80),
                                                                     Image.BILINEAR)
        draw = ImageDraw.Draw(scene)
        for _ in range(150 + 100 * k):
            x, y = int(rng.integers(0, width + 60)), int(rng.integers(0, height + 60))
            draw.rectangle([x, y, x + int(rng.integers(2, 20)), y + int(rng.integers(2, 8))],
                           fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
        scenes.append(np.asarray(scene, dtype=np.int16))
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = dict(options)
        for i in range(seconds * fps):
            scene = scenes[(i // (6 * fps)) % 3]
            dx, dy = (int(v) for v in 40 + 30 * np.sin(i / np.array([9.0, 13.0])))
            frame = scene[dy:dy + height, dx:dx + width] * (0.6 + 0.4 * min(1, (i % 180) / 30))
            frame = frame + rng.integers(-2, 3, (height, width, 1))  # grain
            picture = av.VideoFrame.from_ndarray(frame.clip(0, 255).astype(np.uint8), "rgb24")
            container.mux(stream.encode(picture))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def clip_bytes(name: str, cache: Path) -> bytes:
    path = cache / f"{name}.{FOREIGN[name][0] if name in FOREIGN else 'mp4'}"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        path.write_bytes(foreign_clip(name) if name in FOREIGN else make_clip(*CLIPS[name]))
    return path.read_bytes()


# ---- readers -----------------------------------------------------------------------------------

_LINKED = "BENCH_VIDEO_FFMPEG_LIBS"  #: set once the bench re-ran itself over PyAV's FFmpeg


def reexec_with_pyav_ffmpeg(folder: Path) -> None:
    """Link PyAV's bundled FFmpeg libraries under their plain sonames into ``folder`` and re-run
    this process with it first on ``LD_LIBRARY_PATH`` (the loader reads it at start only), so
    that torchcodec decodes with PyAV's FFmpeg. Does nothing when torchcodec is not installed or
    this process already runs so."""
    if os.environ.get(_LINKED) or importlib.util.find_spec("torchcodec") is None:
        return
    link_pyav_ffmpeg(Path(av.__file__).resolve().parent.parent / "av.libs", folder)
    env = dict(os.environ, **{_LINKED: str(folder)})
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(folder), os.environ.get("LD_LIBRARY_PATH")) if p)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def link_pyav_ffmpeg(bundled: Path, folder: Path) -> Path:
    """Link the FFmpeg libraries PyAV bundles (``bundled``: its ``av.libs``) under their plain
    sonames into ``folder`` (what torchcodec loads), and under their own names too (they find
    each other there: their ``$ORIGIN`` is the folder of the link), and return ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for library in bundled.glob("lib*.so*"):
        plain = re.sub(r"^(lib[\w+-]+?)-[0-9a-f]{8}(\.so\.\d+).*$", r"\1\2", library.name)
        for name in {plain, library.name}:
            if not (folder / name).exists():
                (folder / name).symlink_to(library.resolve())
    return folder


def environment() -> dict:
    """What the readers ran on: the interpreter, torch, the readers' versions, their FFmpeg."""
    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None
    info = {"python": sys.executable, "python_version": platform.python_version(),
            "machine": platform.processor() or platform.machine(),
            "pyav": av.__version__, "pyav_ffmpeg": av.ffmpeg_version_info,
            "torch": version("torch"), "torchcodec": version("torchcodec"),
            "decord": version("decord"), "ffmpeg_libs": os.environ.get(_LINKED),
            "resize": kernel()}
    if "torchcodec.decoders" in sys.modules:
        from torchcodec._core import _ffmpeg_ops

        info["torchcodec_ffmpeg"] = _ffmpeg_ops.get_ffmpeg_library_versions().get(
            "ffmpeg_version")
    return info

def _resize(rgb: np.ndarray) -> np.ndarray:
    """The other readers' frames resized as the project's are (the same kernel for all)."""
    return resize_rgb(rgb, *SIZE[::-1])


def project(data: bytes, positions: list[float], frames: int, sampling: str = "exact"
            ) -> np.ndarray:
    return decode_video_at(data, positions, size=SIZE, max_source_pixels=10**9, frames=frames,
                               sampling=sampling).frames


def decode_all(data: bytes, picks: list[int], frames: int) -> np.ndarray:
    wanted, out = set(picks), []
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        for index, frame in enumerate(container.decode(stream)):
            if index in wanted:
                out.append(video_frame_pixels(frame, SIZE[::-1]))
    return np.stack(out)


def keyframe_check(data: bytes, positions: list[float], frames: int) -> dict:
    """The keyframe mode against a sequential decode: each returned frame is the keyframe
    (``key_frame`` or an I-frame) nearest its pick in time (the earlier one on a tie), with that
    frame's pixels and true timestamp (pts - first pts, seconds); and how many distinct frames
    it returned (each converted once)."""
    from av.video.frame import PictureType

    picks = [round(p) for p in positions]  # a constant-rate clip: the frames at the positions
    video = decode_video_at(data, positions, size=SIZE, max_source_pixels=10**9, frames=frames,
                            sampling="keyframe")
    stamps, keys, pixels, wanted = [], [], {}, set(video.indices)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        base = float(stream.time_base)  # read while open: a closed stream's is freed memory
        for index, frame in enumerate(container.decode(stream)):
            stamps.append(frame.pts)
            if frame.key_frame or frame.pict_type == PictureType.I:
                keys.append(index)
            if index in wanted:
                pixels[index] = video_frame_pixels(frame, SIZE[::-1])
    seconds = [(pts - stamps[0]) * base for pts in stamps]
    nearest = [min(keys, key=lambda k, p=p: (abs(seconds[k] - seconds[p]), k)) for p in picks]
    return {"nearest_keyframes": list(video.indices) == nearest,
            "pixels_equal": all(np.array_equal(f, pixels[k])
                                for f, k in zip(video.frames, video.indices, strict=True)),
            "true_timestamps": all(abs(t - seconds[k]) < 1e-9
                                   for t, k in zip(video.timestamps, video.indices, strict=True)),
            "distinct_frames": len(wanted)}


def load_torchcodec():
    """(reader, None) or (None, why it cannot be used)."""
    try:
        from torchcodec.decoders import VideoDecoder

        VideoDecoder(make_clip(64, 48, 1, 1), seek_mode="exact").get_frames_at([0])
    except Exception as error:  # noqa: BLE001 - the reason is the result
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"

    def read(data, picks, frames):
        decoder = VideoDecoder(data, seek_mode="exact", num_ffmpeg_threads=1)
        batch = decoder.get_frames_at(picks).data.permute(0, 2, 3, 1).numpy()
        return np.stack([_resize(rgb) for rgb in batch])
    return read, None


def load_decord():
    try:
        import decord
    except Exception as error:  # noqa: BLE001 - the reason is the result
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"

    def read(data, picks, frames):
        reader = decord.VideoReader(io.BytesIO(data), num_threads=1)
        batch = reader.get_batch(picks).asnumpy()
        return np.stack([_resize(rgb) for rgb in batch])
    return read, None


# ---- the exact-reader bound --------------------------------------------------------------------

def _is_reference(packet_bytes: bytes) -> bool:
    """An H.264 (avcC, 4-byte lengths) packet holds a slice with nal_ref_idc != 0."""
    at = 0
    while at + 5 <= len(packet_bytes):
        size = int.from_bytes(packet_bytes[at:at + 4], "big")
        header = packet_bytes[at + 4]
        if header & 0x1F in (1, 5) and header >> 5:
            return True
        at += 4 + size
    return False


def packet_costs(data: bytes, picks: list[int]) -> tuple[list, list[float], float]:
    """(packets as (pts, keyframe, reference), CPU seconds of each one's decode, CPU seconds of
    the picks' conversions) from one single-thread sequential decode."""
    info, costs, kept, wanted = [], [], [], set(picks)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        codec = stream.codec_context
        codec.thread_count = 1
        for packet in [*container.demux(stream), None]:
            if packet is not None and not packet.size:
                continue
            if packet is not None:
                info.append((packet.pts, packet.is_keyframe, _is_reference(bytes(packet))))
            start = time.process_time()
            frames = codec.decode(packet)
            spent = time.process_time() - start
            if packet is None:
                costs[-1] += spent
            else:
                costs.append(spent)
            for frame in frames:  # presentation order: the k-th out is frame k
                kept.append(frame if len(kept) in wanted else None)
        start = time.process_time()
        for frame in (f for f in kept if f is not None):
            video_frame_pixels(frame, SIZE[::-1])
        convert = time.process_time() - start
    return info, costs, convert


def bound_seconds(info: list, costs: list[float], picks: list[int], convert_s: float) -> float:
    """CPU of the packets an exact reader must decode for ``picks`` plus the conversions."""
    order = sorted(range(len(info)), key=lambda i: info[i][0])
    keys = [i for i, (_, key, _) in enumerate(info) if key]
    spans = []
    for pick in picks:
        position = order[pick]
        start = max(k for k in keys if k <= position and info[k][0] <= info[position][0])
        spans.append((start, position))
    spans.sort()
    needed, end = set(), -1
    targets = {order[p] for p in picks}
    for start, stop in spans:
        first = start if start > end + 1 else end + 1
        needed.update(i for i in range(first, stop + 1) if info[i][2] or i in targets
                      or info[i][1])
        end = max(end, stop)
    return sum(costs[i] for i in needed) + convert_s


# ---- the run -----------------------------------------------------------------------------------

def run_clip(name: str, data: bytes, count: int, rounds: int, readers: dict) -> dict:
    with av.open(io.BytesIO(data)) as container:
        frames = sum(1 for p in container.demux(video=0) if p.size)
        h264 = container.streams.video[0].codec_context.name == "h264"  # the bound reads NALs
    with av.open(io.BytesIO(data)) as container:
        key_count = sum(1 for p in container.demux(video=0) if p.size and p.is_keyframe)
    positions = np.linspace(0, frames - 1, count).tolist()
    picks = [round(p) for p in positions]
    reference = decode_all(data, picks, frames)
    calls = {"project": lambda: project(data, positions, frames),
             "decode_all": lambda: decode_all(data, picks, frames),
             "keyframe": lambda: project(data, positions, frames, "keyframe")}
    calls.update({k: (lambda r=r: r(data, picks, frames)) for k, r in readers.items()})
    equal = {k: bool(np.array_equal(f(), reference)) for k, f in calls.items() if k != "keyframe"}
    keyframes = keyframe_check(data, positions, frames)
    times = {k: [] for k in [*calls, "bound", "conversions"]}
    for round_ in range(rounds + 1):  # round 0 warms up
        for key, call in calls.items():
            start = time.process_time()
            call()
            if round_:
                times[key].append(time.process_time() - start)
        if round_:
            info, costs, convert = packet_costs(data, picks)
            if h264:
                times["bound"].append(bound_seconds(info, costs, picks, convert))
            times["conversions"].append(convert)
    if not h264:
        del times["bound"]
    median = {k: statistics.median(v) for k, v in times.items()}
    # ratios per round (the readers and the bound of one round ran back to back), then median
    per_round = {k: [v / p for v, p in zip(times[k], times["project"], strict=True)]
                 for k in times if k not in ("project", "conversions")}
    ratios = {"per_round_over_project": {k: {"median": statistics.median(v),
                                             "range": [min(v), max(v)]}
                                         for k, v in per_round.items()}}
    if h264:
        bound = [b / p for b, p in zip(times["bound"], times["project"], strict=True)]
        ratios.update(bound_over_project=statistics.median(bound),
                      bound_over_project_range=[min(bound), max(bound)],
                      bound_over_project_least=min(times["bound"]) / min(times["project"]))
    return {"clip": name, "frames": frames, "keyframes": key_count, "picks": count,
            "cpu_s": median, "ratios": ratios,
            "equal": equal, "keyframe_check": keyframes, "rounds_cpu_s": times}


def _ratio(result: dict, slow: str, fast: str, missing: dict) -> str:
    """``slow``'s CPU over ``fast``'s: the median of the per-round ratios and their range,
    flagged when a reader's frames are not decode_all's."""
    if slow in missing or fast in missing or slow not in result["rounds_cpu_s"]:
        return "n/a"
    rounds = [a / b for a, b in zip(result["rounds_cpu_s"][slow], result["rounds_cpu_s"][fast],
                                    strict=True)]
    flag = "".join(" (frames differ)" for key in (slow, fast)
                   if not result["equal"].get(key, True))
    return (f"{statistics.median(rounds):.2f}x ({min(rounds):.2f}-{max(rounds):.2f})"
            f"{flag}")


def table(results: list[dict], missing: dict) -> str:
    head = ("| clip, picks | keyframes | decode-all CPU ms | project vs decode-all | torchcodec "
            "exact vs decode-all | decord vs decode-all | project vs torchcodec | project vs "
            "decord | bound / project | keyframe mode vs decode-all | keyframe vs decode-all, "
            "decoding only |")
    lines = [head, "|" + "---|" * 11]
    for r in results:
        t = r["cpu_s"]
        # the keyframe mode converts each distinct frame once
        check = r["keyframe_check"]
        converted = t["conversions"] * check["distinct_frames"] / r["picks"]
        decoding = (t["decode_all"] - t["conversions"]) / (t["keyframe"] - converted)
        flag = "" if all(v for k, v in check.items() if k != "distinct_frames") else " (wrong)"
        bound = _ratio(r, "bound", "project", missing) if "bound" in t else "n/a (not H.264)"
        lines.append(
            f"| {r['clip']}, {r['picks']} | {r.get('keyframes', '?')} | "
            f"{1000 * t['decode_all']:.0f} | "
            + " | ".join(_ratio(r, "decode_all", key, missing)
                         for key in ("project", "torchcodec", "decord"))
            + f" | {_ratio(r, 'torchcodec', 'project', missing)} | "
            f"{_ratio(r, 'decord', 'project', missing)} | {bound} | "
            f"{_ratio(r, 'decode_all', 'keyframe', missing)}{flag} | {decoding:.1f}x "
            f"({check['distinct_frames']} frames) |")
    lines += [f"\n{k}: not measured ({why})" for k, why in missing.items()]
    return "\n".join(lines)


@click.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_out/video_decode"))
@click.option("--cache", type=click.Path(path_type=Path), default=None,
              help="folder of the generated clips (default: <out>/clips)")
@click.option("--rounds", default=5, show_default=True)
@click.option("--quick", is_flag=True, help="the 2 s GOP clip only, 2 rounds")
@click.option("--clips", "only", multiple=True, type=click.Choice([*CLIPS, *FOREIGN]),
              help="run only these clips (repeatable; default: all of CLIPS; FOREIGN's by name)")
@click.option("--system-ffmpeg", is_flag=True,
              help="torchcodec loads the system's FFmpeg, not PyAV's bundled one")
def main(out: Path, cache: Path | None, rounds: int, quick: bool, only: tuple,
         system_ffmpeg: bool) -> None:
    """Time the frame readers side by side (see the module docstring)."""
    if not system_ffmpeg:
        reexec_with_pyav_ffmpeg(out / "ffmpeg-libs")
    cache = cache or out / "clips"
    readers, missing = {}, {}
    for key, load in (("torchcodec", load_torchcodec), ("decord", load_decord)):
        reader, why = load()
        if reader is None:
            missing[key] = why
        else:
            readers[key] = reader
    names = ["360p_60s_gop2"] if quick else list(only or CLIPS)
    rounds = 2 if quick else rounds
    results = []
    for name in names:
        data = clip_bytes(name, cache)
        for count in PICKS:
            results.append(run_clip(name, data, count, rounds, readers))
            print(json.dumps(results[-1]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    report = {"environment": environment(), "rounds": rounds, "size": SIZE,
              "missing": missing, "results": results}
    (out / "video_decode.json").write_text(json.dumps(report, indent=1))
    print(table(results, missing))
    print("\n" + ", ".join(f"{k}: {v}" for k, v in report["environment"].items()))


if __name__ == "__main__":
    main()
