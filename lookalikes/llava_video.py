"""Local lookalike of lmms-lab/LLaVA-Video-178K (video captions, open-ended and multiple-choice QA).

Owns the layout, as the hub repository has it (../shared/reference/hub-layouts.md):
- README.md `configs:` card with the hub's globs (`<config>/*cap*.json`, `*oe*`, `*mc*`), one JSON
  array per split (`0_30_s_academic_v0_1_cap_processed.json`,
  `0_30_s_academic_oe_v0_1_qa_processed.json`, `0_30_s_nextqa_mc_qa_processed.json`, ...), videos
  in `<folder>/<folder>_videos_<k>.tar.gz` parts (or extracted in the folder);
- the activitynet quirk: the card points `0_30_s_activitynet` at `0_30_s_activitynet/*oe*.json`,
  but its files and video parts live in `0_30_s_activitynetqa/` (loading the card's globs fails);
- `llava_hound`: only `sharegptvideo_qa_255k_processed.json`, whose `video` values are ids of frame
  folders published in another repository; they are written next to this one, in
  `ShareGPTVideo/train_300k/<id>/` (JPEG frames), for `--frames-root`;
- the real multiple-choice text (`Question?\\nOptions:\\nA. ...\\nE. ...\\nPlease provide your
  answer by stating the letter followed by the full option.`, answers like `E. it does not
  move.`) and
  `data_source` values (the config's folder name);
- the planted pitfalls, each in `lookalike_manifest.json`.
Each clip shows a coloured square moving left/right/up/down, so every caption and answer can be
checked against the pixels.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from . import media
from .files import Manifest, fresh_dir, write_card, write_json, write_tar_gz

DATASET, FOLDER = "llava-video", "LLaVA-Video-178K"
#: one config of each kind: the v0_1 sources (3 splits), nextqa (oe + mc), activitynet (oe, the
#: folder quirk), perceptiontest (mc), llava_hound (frames elsewhere)
DEFAULT_CONFIGS = ["0_30_s_academic_v0_1", "0_30_s_youtube_v0_1", "0_30_s_nextqa",
                   "0_30_s_activitynet", "0_30_s_perceptiontest", "llava_hound"]
FRAMES_FOLDER = "ShareGPTVideo/train_300k"  #: where llava_hound's frame folders go (under root)
LLAVA_HOUND_FILE = "sharegptvideo_qa_255k_processed.json"
N_VIDEOS = {"academic": 6, "youtube": 4}  # others: 3
TWO_PART_CONFIGS = frozenset({"0_30_s_academic_v0_1"})
KIND = {"caption": "cap", "open_ended": "oe", "multi_choice": "mc"}
PHRASE = {"left": "to the left", "right": "to the right", "up": "upwards", "down": "downwards"}
STILL = "it does not move"
MC_SUFFIX = "Please provide your answer by stating the letter followed by the full option."
FIXUP = "image_placeholder_is_video"
REPEATED = "repeated_video_placeholder_removed"


def folder_of(config: str) -> str:
    """The folder a config's files live in (the activitynet configs' is `<config>qa`)."""
    return f"{config}qa" if config.endswith("_activitynet") else config


def split_files(config: str) -> dict[str, str]:
    """Split name -> annotation file name inside the config's folder, as named on the hub."""
    if config == "llava_hound":
        return {"open_ended": LLAVA_HOUND_FILE}
    if config.endswith("_v0_1"):
        stem = config.removesuffix("_v0_1")
        return {"caption": f"{config}_cap_processed.json",
                "open_ended": f"{stem}_oe_v0_1_qa_processed.json",
                "multi_choice": f"{stem}_mc_v0_1_qa_processed.json"}
    kinds = {"activitynet": ["open_ended"], "perceptiontest": ["multi_choice"]}.get(
        _source(config), ["open_ended", "multi_choice"])
    return {split: f"{folder_of(config)}_{KIND[split]}_qa_processed.json" for split in kinds}


def card_globs(config: str) -> dict[str, str]:
    """The README's data_files of a config (wrong for activitynet, as on the hub)."""
    if config == "llava_hound":
        return {"open_ended": f"llava_hound/{LLAVA_HOUND_FILE}"}
    return {split: f"{config}/*{KIND[split]}*.json" for split in split_files(config)}


def _source(config: str) -> str:
    for source in ("academic", "youtube", "nextqa", "activitynet", "perceptiontest", "hound"):
        if source in config:
            return source
    return "other"


@dataclass
class _Video:
    path: str  #: relative to the config folder (llava_hound: the frame folder id)
    stem: str
    direction: str
    colour: str
    data: bytes | list[bytes] | None  #: mp4 bytes, frames (llava_hound), None: in no part
    fate: str = "kept"  #: kept | reject:<reason>
    pitfall: str | None = None


def _video_path(config: str, k: int, stem: str) -> str:
    source = _source(config)
    if source == "academic":
        return f"academic_source/{('Charades', 'ego4d', 'youcook2')[k % 3]}/{stem}.mp4"
    if source == "youtube":
        return f"liwei_youtube_videos/videos/youtube_video_2024/ytb_{stem}.mp4"
    if source == "nextqa":
        return f"NextQA/NExTVideo/{1000 + k}/{stem}.mp4"
    if source == "activitynet":
        return f"ActivityNet-QA/videos/{stem}.mp4"
    if source == "perceptiontest":
        return f"perception_test/videos/video_{stem}.mp4"
    return stem  # llava_hound: a frame folder id


def _clip(rng: random.Random, direction: str, colour: str, codec: str = "h264") -> bytes:
    w = rng.choice((64, 96, 128, 160))
    return media.moving_square_clip(direction, colour, size=(w, w * 3 // 4),
                                    fps=rng.randint(8, 12), seconds=rng.choice((1, 1.5, 2, 3, 4)),
                                    codec=codec)


def _videos(rng: random.Random, config: str, pitfalls: list[str]) -> list[_Video]:
    """The config's videos in a shuffled order, pitfall videos included and marked."""
    videos = []
    n = N_VIDEOS.get(_source(config), 3)
    for k in range(n + len(pitfalls)):
        stem = f"v_{rng.getrandbits(40):010x}"
        direction, colour = rng.choice(media.DIRECTIONS), rng.choice(list(media.COLOURS))
        pitfall = pitfalls[k - n] if k >= n else None
        video = _Video(_video_path(config, k, stem), stem, direction, colour, None,
                       pitfall=pitfall)
        if pitfall == "missing_video":
            video.fate = "reject:missing_video"
        elif pitfall == "unreadable_video":
            video.data = b"\x00\x00\x00\x18ftypmp42" + rng.randbytes(900)  # mp4 magic, then junk
            video.fate = "reject:unreadable_video"
        elif pitfall == "zero_frame_video":
            video.data, video.fate = media.audio_only_mp4(), "reject:zero_frame_video"
        elif pitfall == "several_videos":
            video.data, video.fate = _clip(rng, direction, colour), "reject:several_videos"
        elif config == "llava_hound":
            video.data = media.moving_square_frames(direction, colour, size=(64, 48),
                                                    n=rng.randint(4, 8))
        else:
            codec = "mpeg4" if pitfall == "mpeg4_video" else "h264"
            video.data = _clip(rng, direction, colour, codec)
        videos.append(video)
    rng.shuffle(videos)
    return videos


def _choice(rng: random.Random, question: str, options: list[str], answer: str):
    """The hub's multiple-choice text and answer form (`E. it does not move.`)."""
    rng.shuffle(options)
    letters = "ABCDE"[: len(options)]
    lines = "\n".join(f"{c}. {o}" for c, o in zip(letters, options, strict=True))
    letter = letters[options.index(answer)]
    return f"{question}\nOptions:\n{lines}\n{MC_SUFFIX}", f"{letter}. {answer}."


def _turns(rng: random.Random, v: _Video, split: str) -> list[tuple[str, str]]:
    """(human, gpt) turns for one record about `v`."""
    ask = f"Which direction does the {v.colour} square move?"
    if split == "caption":
        return [("Please describe this video in detail.",
                 f"The video shows a {v.colour} square on a dark gray background. Throughout the "
                 f"clip the square moves steadily {PHRASE[v.direction]} and nothing else moves.")]
    if split == "multi_choice":
        options = [PHRASE[d].replace("to the ", "") for d in media.DIRECTIONS] + [STILL]
        turns = [_choice(rng, ask, options, PHRASE[v.direction].replace("to the ", ""))]
        if rng.random() < 0.5:
            colours = rng.sample([c for c in media.COLOURS if c != v.colour], 3) + [v.colour]
            turns.append(_choice(rng, "What colour is the moving square?", colours, v.colour))
        return turns
    pool = [(ask, f"It moves {PHRASE[v.direction]}."),
            ("What colour is the moving square?", f"It is {v.colour}."),
            ("What shape moves across the frame?", "A square.")]
    return pool[: rng.randint(1, 3)]


def _record(rng: random.Random, v: _Video, split: str, config: str, rid, repeat: bool) -> dict:
    """One record; `repeat`: later human turns repeat the placeholder (as some real ones do)."""
    conv = []
    for k, (human, gpt) in enumerate(_turns(rng, v, split)):
        conv += [{"from": "human", "value": ("<image>\n" if k == 0 or repeat else "") + human},
                 {"from": "gpt", "value": gpt}]
    video = [v.path, v.path.replace(v.stem, v.stem + "_b")] if v.pitfall == "several_videos" \
        else v.path
    return {"id": rid, "conversations": conv, "data_source": folder_of(config), "video": video}


def _ids(videos: list[_Video], first_split: bool, mixed: bool) -> list:
    """Record ids: the video stem; in the mixed-id config ints first, then int/str mixed."""
    if not mixed:
        return [v.stem for v in videos]
    return [1000 + k if first_split or k % 2 == 0 else v.stem for k, v in enumerate(videos)]


def _write_videos(cfg_dir: Path, config: str, videos: list[_Video], extracted: bool,
                  man: Manifest, pitfalls: bool) -> None:
    present = [(v.path, v.data) for v in videos if v.data is not None]
    if extracted:
        for path, data in present:
            (cfg_dir / path).parent.mkdir(parents=True, exist_ok=True)
            (cfg_dir / path).write_bytes(data)
        return
    two = config in TWO_PART_CONFIGS and len(present) > 1
    parts = [present[: len(present) // 2], present[len(present) // 2 :]] if two else [present]
    folder = cfg_dir.name
    for k, members in enumerate(parts, start=1):
        name = f"{folder}_videos_{k}.tar.gz"
        if two and k == 1:  # directory entries first, as `tar czf` writes them
            dirs = sorted({p.rsplit("/", i)[0] + "/" for p, _ in members for i in (1, 2)})
            members = [(d, None) for d in dirs] + members
        if two and k == 2:
            members = [("./" + p, d) for p, d in members]
            man.note(f"{config}/{name}", None, None, "member_names_with_dot_slash", "kept")
            if pitfalls:
                members.append(("../../escape.mp4", members[0][1]))
                man.note(f"{config}/{name}", None, "../../escape.mp4", "unsafe_tar_member",
                         "ignored")
        write_tar_gz(cfg_dir / name, members)


def _write_frames(frames_root: Path, videos: list[_Video]) -> None:
    for v in videos:
        for k, frame in enumerate(v.data or []):
            path = frames_root / v.path / f"c01_{k + 1:04d}.jpeg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(frame)


#: pitfall -> home config; a pitfall whose home is not built goes to the first config
#: (mixed_type_ids needs a config with two splits or more, else it is not planted).
PITFALLS = {"missing_video": "0_30_s_academic_v0_1", "mpeg4_video": "0_30_s_academic_v0_1",
            "unreadable_video": "0_30_s_youtube_v0_1",
            "zero_frame_video": "0_30_s_youtube_v0_1", "mixed_type_ids": "0_30_s_nextqa",
            "several_videos": "0_30_s_nextqa", "repeated_placeholder": "0_30_s_youtube_v0_1"}


def build_llava_video(root: Path, *, configs: list[str] | None = None, pitfalls: bool = True,
                      seed: int = 0, extracted: bool = False) -> Path:
    """Build a LLaVA-Video-178K lookalike under `root/LLaVA-Video-178K` (and llava_hound's frames
    under `root/ShareGPTVideo/train_300k`).

    Args:
        root: Parent folder; `root/LLaVA-Video-178K` (and `root/ShareGPTVideo`) are replaced.
        configs: Config names (default `DEFAULT_CONFIGS`); `*_v0_1` configs get caption,
            open_ended and multi_choice, public-dataset configs open_ended and/or multi_choice,
            llava_hound open_ended with its frames outside the repository.
        pitfalls: Plant the pitfalls of `PITFALLS` (missing, unreadable, zero-frame and MPEG-4
            videos, mixed-type ids, several videos in a record, placeholders repeated in later
            turns, an unsafe tar member).
        seed: Everything is a function of the seed.
        extracted: Write the videos extracted in each config folder instead of tar.gz parts.

    Returns:
        The dataset root. The manifest's `skipped_by_default` counts llava_hound's rows (a default
        conversion skips them) and `frames_root` is where its frames are (relative to the root).
    """
    configs = list(configs or DEFAULT_CONFIGS)
    if not configs:
        raise ValueError("build_llava_video: configs must name at least one config")
    out = fresh_dir(Path(root) / FOLDER)
    frames_root = Path(root) / FRAMES_FOLDER
    if "llava_hound" in configs:
        fresh_dir(frames_root.parent)
    man, card = Manifest(DATASET), {}
    skipped, frames_expect = {}, {}
    homes = {p: home if home in configs else configs[0] for p, home in PITFALLS.items()}
    for config in configs:
        rng = random.Random(f"{DATASET}/{config}/{seed}")
        mine = [p for p, home in homes.items() if pitfalls and home == config]
        media_pitfalls = [p for p in mine if p not in ("mixed_type_ids", "repeated_placeholder")]
        videos = _videos(rng, config, media_pitfalls if config != "llava_hound" else [])
        files = split_files(config)
        mixed = "mixed_type_ids" in mine and len(files) > 1
        card[config] = card_globs(config)
        cfg_dir = out / folder_of(config)
        for s, (split, name) in enumerate(files.items()):
            ids = _ids(videos, s == 0, mixed)
            repeat = "repeated_placeholder" in mine and split == "open_ended"
            records = [_record(rng, v, split, config, rid, repeat)
                       for v, rid in zip(videos, ids, strict=True)]
            write_json(cfg_dir / name, records)
            key = f"{config}/{split}"
            man.rows[key] = len(records)
            kept = sum(v.fate == "kept" for v in videos)
            repeats = sum(v.fate == "kept" and len(r["conversations"]) > 2
                          for v, r in zip(videos, records, strict=True)) if repeat else 0
            if config == "llava_hound":  # skipped by default; with --frames-root:
                skipped[config] = skipped.get(config, 0) + len(records)
                frames_expect = {"samples": kept, "fixups": {FIXUP: kept}}
                continue
            man.expected_samples[key] = kept
            man.expected_fixups[FIXUP] += kept
            if repeats:
                man.expected_fixups[REPEATED] += repeats
                man.note(key, None, None, "placeholder_repeated_in_later_turns",
                         f"fixup:{REPEATED}")
            for k, v in enumerate(videos):
                if v.fate != "kept":
                    man.expected_rejects[v.fate.removeprefix("reject:")] += 1
                if v.pitfall:
                    man.note(key, k, ids[k], v.pitfall, v.fate)
            if any(len(r["conversations"]) > 2 for r in records):
                man.note(key, None, None, "several_qa_turns_in_one_record", "kept")
            if mixed and s == len(files) - 1:
                man.note(key, None, None, "mixed_type_ids_load_dataset_raises", "error")
        if config == "llava_hound":
            _write_frames(frames_root, videos)
            man.note(f"{config}/open_ended", None, None, "videos_are_frame_folders_elsewhere",
                     "skipped by default; converted with --frames-root")
        else:
            _write_videos(cfg_dir, config, videos, extracted, man, pitfalls)
        if folder_of(config) != config:
            man.note(f"{config}/open_ended", None, None,
                     f"files_in_{folder_of(config)}_not_where_the_card_points", "kept")
    write_card(out, card, "LLaVA-Video-178K (local lookalike)",
               "Synthetic stand-in with the hub's schema and layout; see lookalike_manifest.json.")
    man.extra = {"skipped_by_default": skipped,  # a default conversion skips these configs
                 "frames_root": f"../{FRAMES_FOLDER}" if skipped else None,
                 "with_frames_root": frames_expect}  # what --frames-root adds
    man.write(out)
    return out
