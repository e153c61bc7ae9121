"""The Hugging Face side of ``bench/bench_loader.py``: the paths users run, timed in their own venv.

transformers' torchvision image-processor backend only imports beside a torch that PyPI ships
with a torchvision (``make infer-venv``'s venv; the project's own venv has a CPU torch without
one), so this worker runs there, as a subprocess of the bench, and imports nothing of the
project. It reads one JSON request a line on stdin and answers one JSON line on stdout:

- ``{"op": "versions"}`` -> the versions of what it runs;
- ``{"op": "keep_memory"}`` -> ``{"kept": bool}``: glibc's mmap and trim thresholds raised to
  1 GiB in this process (what ``energon_tasks.pixel_memory`` does in the project's loaders), for
  the bench's ``--reference-keeps-memory``;
- ``{"op": "run", "path": ..., "family": {...settings}, "files": [...], "targets": [[h, w]],
  "video": {...} | null, "save": "x.npy" | null}`` -> ``{"cpu_s": ..., "shape": [...]}``: the
  process CPU time (``time.process_time`` in this process) of one call of ``path`` on the media
  in ``files`` (read into memory before the clock starts; a video is read from its file, as
  qwen-vl-utils requires a path), ``pixel_values`` (images) or ``pixel_values_videos`` saved to
  ``save`` when given (after the clock stops); or ``{"error": ...}``.

Image paths (``IMAGE_PATHS``), per image of a sample, one thread:

- ``fetch_image + torchvision processor`` / ``fetch_image + PIL processor``: qwen-vl-utils'
  ``fetch_image`` (open, RGB, ``smart_resize``, PIL bicubic) at the size the project planned
  (``resized_height`` / ``resized_width``), then transformers' ``Qwen2VLImageProcessor``
  (torchvision backend, the default where torchvision imports) or ``Qwen2VLImageProcessorPil``,
  configured as the family's processor with limits that keep the fetched size (Qwen's own
  recipe: ``process_vision_info`` then the processor);
- ``torchvision processor alone`` / ``PIL processor alone``: the processor on the opened image,
  resizing it itself within the family's pixel limits (what a script that skips qwen-vl-utils
  runs; its resize is torchvision's on uint8 tensors, or PIL's);
- Nemotron-Omni: ``NemotronH_Omni_Reasoning_V3ImageProcessor`` (torchvision backend: float32
  resize with torch's antialiased bicubic) with the family's patch limits.

Video paths: qwen-vl-utils' ``fetch_video`` with its torchcodec or decord backend (``nframes``
and the size the project planned), then the family's video processor (Qwen2-VL's / Qwen3-VL's);
Nemotron-Omni: torchcodec's or decord's frames at the project's indices, then its video
processor.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import sys
import time

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("TORCHCODEC_NUM_THREADS", "1")  # qwen-vl-utils' torchcodec reader: 1 thread

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

IMAGE_PATHS = {"qwen": ("fetch_image + torchvision processor", "fetch_image + PIL processor",
                        "torchvision processor alone", "PIL processor alone"),
               "nemotron": ("processor (torchvision backend)",)}
VIDEO_PATHS = {"qwen": ("fetch_video (torchcodec) + video processor",
                        "fetch_video (decord) + video processor"),
               "nemotron": ("torchcodec + video processor", "decord + video processor")}

_bytes: dict[str, bytes] = {}
_processors: dict[tuple, object] = {}


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for package in ("torch", "torchvision", "transformers", "qwen-vl-utils", "pillow", "numpy",
                    "torchcodec", "decord", "av"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def processor(family: dict, path: str):
    """The family's transformers processor for ``path``, built once."""
    key = (json.dumps(family, sort_keys=True), path)
    if key in _processors:
        return _processors[key]
    qwen = family["kind"] == "qwen"
    common = {"image_mean": family["image_mean"], "image_std": family["image_std"]}
    if "video" in path and qwen:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        cls = Qwen3VLVideoProcessor if family["patch_size"] == 16 else Qwen2VLVideoProcessor
        made = cls(patch_size=family["patch_size"], merge_size=family["merge_size"],
                   temporal_patch_size=family["temporal_patch_size"], do_resize=False,
                   do_sample_frames=False, **common)
    elif "video" in path:
        from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import (
            NemotronH_Omni_Reasoning_V3VideoProcessor,
        )

        made = NemotronH_Omni_Reasoning_V3VideoProcessor(
            patch_size=family["patch_size"], temporal_patch_size=family["temporal_patch_size"],
            video_target_num_patches=family["video_target_num_patches"],
            norm_mean=family["image_mean"], norm_std=family["image_std"],  # what it reads
            do_sample_frames=False, **common)
    elif qwen:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        cls = Qwen2VLImageProcessor if "torchvision" in path else Qwen2VLImageProcessorPil
        # after fetch_image the processor keeps the fetched size; alone it resizes within the
        # family's limits
        low, high = ((family["min_pixels"], family["max_pixels"]) if "alone" in path
                     else (family["patch_size"] ** 2, 10**9))
        made = cls(patch_size=family["patch_size"], merge_size=family["merge_size"],
                   temporal_patch_size=family["temporal_patch_size"],
                   size={"shortest_edge": low, "longest_edge": high}, **common)
    else:
        from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import (
            NemotronH_Omni_Reasoning_V3ImageProcessor,
        )

        made = NemotronH_Omni_Reasoning_V3ImageProcessor(
            patch_size=family["patch_size"], downsample_ratio=1 / family["merge_size"],
            min_num_patches=family["min_patches"], max_num_patches=family["max_patches"],
            max_model_len=10**6, **common)
    _processors[key] = made
    return made


def run_images(path: str, family: dict, datas: list[bytes], targets: list) -> torch.Tensor:
    proc = processor(family, path)
    if path.startswith("fetch_image"):
        from qwen_vl_utils import fetch_image

        images = [fetch_image({"image": Image.open(io.BytesIO(data)), "resized_height": h,
                               "resized_width": w}, image_patch_size=family["patch_size"])
                  for data, (h, w) in zip(datas, targets, strict=True)]
        return proc(images=images, return_tensors="pt")["pixel_values"]
    # the processors alone, one image a call (the Nemotron-Omni processor gives every image of
    # a call the same budget)
    return torch.cat([proc(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
                      ["pixel_values"] for data in datas])


def run_video(path: str, family: dict, file: str, video: dict) -> torch.Tensor:
    proc = processor(family, path)
    backend = "torchcodec" if "torchcodec" in path else "decord"
    if family["kind"] == "qwen":
        from qwen_vl_utils import vision_process

        if vision_process.FORCE_QWENVL_VIDEO_READER != backend:  # the reader fetch_video uses
            vision_process.FORCE_QWENVL_VIDEO_READER = backend
            vision_process.get_video_reader_backend.cache_clear()
        height, width = video["size"]
        frames = vision_process.fetch_video(
            {"video": file, "nframes": video["frames"], "resized_height": height,
             "resized_width": width}, image_patch_size=family["patch_size"])
        return proc(videos=[frames], return_tensors="pt")["pixel_values_videos"]
    if backend == "torchcodec":
        from torchcodec.decoders import VideoDecoder

        frames = VideoDecoder(file, num_ffmpeg_threads=1).get_frames_at(video["indices"]).data
    else:
        import decord

        reader = decord.VideoReader(file, num_threads=1)
        frames = torch.from_numpy(reader.get_batch(video["indices"]).asnumpy()).permute(0, 3, 1, 2)
    return proc(videos=[frames], return_tensors="pt")["pixel_values_videos"]


def handle(request: dict) -> dict:
    if request["op"] == "versions":
        return versions()
    if request["op"] == "keep_memory":
        import ctypes

        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # glibc: M_MMAP_ / M_TRIM_THRESHOLD
        return {"kept": mallopt is not None and all(mallopt(k, 1 << 30) for k in (-3, -1))}
    path, family = request["path"], request["family"]
    for file in request["files"]:
        if file not in _bytes:
            with open(file, "rb") as handle_:
                _bytes[file] = handle_.read()
    start = time.process_time()
    if request.get("video"):
        out = run_video(path, family, request["files"][0], request["video"])
    else:
        out = run_images(path, family, [_bytes[f] for f in request["files"]], request["targets"])
    spent = time.process_time() - start
    if request.get("save"):
        np.save(request["save"], out.numpy().reshape(-1, out.shape[-1]) if out.ndim == 2
                else out.numpy())
    return {"cpu_s": spent, "shape": list(out.shape)}


def main() -> None:
    torch.set_num_threads(1)
    answers, sys.stdout = sys.stdout, sys.stderr  # what a library prints goes to stderr
    for line in sys.stdin:
        try:
            answer = handle(json.loads(line))
        except Exception as error:  # noqa: BLE001 - reported to the bench, which names it
            answer = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
