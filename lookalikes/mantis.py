"""Local lookalike of TIGER-Lab/Mantis-Instruct (interleaved multi-image conversations).

Owns the Mantis layout: README.md `configs:` card, `<config>/<split>-00000-of-00001.parquet`
(id, images: list<struct<bytes=null, path>>, conversation, source), `<config>/<split>_images.zip`
or `train_images_part{1,2}.zip` + `train_images_zips.txt`, and the planted pitfalls, each recorded
in `lookalike_manifest.json`. Every image shows what its question asks (shape colour, counts,
words), so a tiny model could learn from the media.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from datasets import Features, Image, List, Value

from . import media
from .files import Manifest, card_info, fresh_dir, shard_names, write_card, write_parquet, write_zip

DATASET, FOLDER = "mantis", "Mantis-Instruct"
DEFAULT_CONFIGS = {"birds-to-words": 8, "nlvr2": 8, "llava_665k_multi": 10,
                   "visual_story_telling": 6}
VAL_CONFIGS = frozenset({"birds-to-words", "chartqa", "dreamsim", "nlvr2"})  # as on the hub
PART_ZIP_CONFIGS = frozenset({"llava_665k_multi"})
IMAGE_FEATURE_CONFIGS = frozenset({"nlvr2", "llava_665k_multi"})  # others: plain struct list
WORDS = ("apple", "river", "cloud", "tiger", "lamp", "chair", "piano", "bread", "stone", "kite")
_TURN = {"role": Value("string"), "content": Value("string")}
_STRUCT = {"bytes": Value("binary"), "path": Value("string")}


def _features(config: str) -> Features:
    images = Image(decode=False) if config in IMAGE_FEATURE_CONFIGS else _STRUCT
    return Features({"id": Value("string"), "images": List(images),
                     "conversation": List(_TURN), "source": Value("string")})


@dataclass
class _Img:
    path: str  #: member name in the zip (relative to the zip root)
    data: bytes | None  #: None: referenced by the row but absent from every zip


@dataclass
class _Row:
    id: str
    images: list[_Img] | None
    conversation: list[dict]
    expect: str = "kept"  #: kept | reject:<reason>
    fixup: str | None = None
    pitfall: str | None = None


class _Ctx:
    """Per config/split state: rng, image naming, default image format."""

    def __init__(self, rng: random.Random, config: str, split: str):
        self.rng, self.config, self.split = rng, config, split
        self.n = self.n_rows = 0
        self.fmt = "png" if config == "nlvr2" else "jpeg"

    def image(self, pil, fmt: str | None = None, ext: str | None = None) -> _Img:
        fmt = fmt or self.fmt
        ext = ext or ("png" if fmt.startswith("png") else "jpg")
        self.n += 1
        path = f"{self.split}_images/{self.n // 10:03d}/{self.config}_{self.n:05d}.{ext}"
        return _Img(path, media.encode_image(pil, fmt))

    def size(self) -> tuple[int, int]:
        return 2 * self.rng.randint(32, 80), 2 * self.rng.randint(24, 60)

    def shape(self, count: int = 1, size=None, fmt=None, ext=None) -> tuple[_Img, str, str]:
        shape, colour = self.rng.choice(media.SHAPES), self.rng.choice(list(media.COLOURS))
        pil = media.shapes_image(self.rng, size or self.size(), shape, colour, count)
        return self.image(pil, fmt, ext), shape, colour

    def row_id(self) -> str:
        self.n_rows += 1
        return f"{self.config}_{self.split}_{self.n_rows:04d}"


def _conv(*texts: str) -> list[dict]:
    return [{"role": "user" if k % 2 == 0 else "assistant", "content": t}
            for k, t in enumerate(texts)]


def _colour_task(ctx: _Ctx, k: int = 2, fmt=None, ext=None) -> _Row:
    """k one-shape images, placeholders at the start; answer is a colour name."""
    drawn = [ctx.shape(fmt=fmt, ext=ext) for _ in range(k)]
    j = ctx.rng.randrange(k)
    question = f"What colour is the {drawn[j][1]} in image {j + 1}?"
    return _Row(ctx.row_id(), [d[0] for d in drawn], _conv("<image>" * k + question, drawn[j][2]))


def _compare_task(ctx: _Ctx) -> _Row:
    """nlvr2-like: two images with different counts; answer True/False."""
    a, b = ctx.rng.sample(range(1, 6), 2)
    shape, colour = ctx.rng.choice(media.SHAPES), ctx.rng.choice(list(media.COLOURS))
    imgs = [ctx.image(media.shapes_image(ctx.rng, ctx.size(), shape, colour, n)) for n in (a, b)]
    text = (f"<image><image>\nThe left image contains more {shape}s than the right image. "
            "True or False?")
    return _Row(ctx.row_id(), imgs, _conv(text, str(a > b)))


def _count_task(ctx: _Ctx, size=None, fmt=None, n_images: int | None = None) -> _Row:
    """llava_665k_multi-like: one placeholder per turn, a count then a text-only follow-up."""
    turns, imgs = [], []
    for _ in range(n_images or ctx.rng.randint(1, 3)):
        n = ctx.rng.randint(1, 5)
        img, shape, colour = ctx.shape(n, size=size, fmt=fmt)
        imgs.append(img)
        turns += [f"<image>\nHow many {shape}s are in this image?", str(n)]
    turns += ["What colour are the shapes in the last image?", colour]
    return _Row(ctx.row_id(), imgs, _conv(*turns))


def _story_task(ctx: _Ctx, n: int | None = None) -> _Row:
    """visual_story_telling-like: n word images interleaved as `Image i: <image>`."""
    words = [ctx.rng.choice(WORDS) for _ in range(n or ctx.rng.randint(3, 6))]
    imgs = [ctx.image(media.word_image(w, (96, 48))) for w in words]
    text = "".join(f"Image {i + 1}: <image>\n" for i in range(len(words)))
    return _Row(ctx.row_id(), imgs, _conv(text + "Read the word in each image, in order.",
                                          " ".join(words)))


TASKS: dict[str, Callable[[_Ctx], _Row]] = {
    "birds-to-words": _colour_task, "nlvr2": _compare_task,
    "llava_665k_multi": _count_task, "visual_story_telling": _story_task,
}


def _mark(row: _Row, pitfall: str, expect: str = "kept", fixup: str | None = None) -> _Row:
    row.pitfall, row.expect, row.fixup = pitfall, expect, fixup
    return row


def _fewer_placeholders(ctx):
    row = _colour_task(ctx, k=3)
    row.conversation[0]["content"] = row.conversation[0]["content"].replace("<image>", "", 2)
    return [_mark(row, "fewer_placeholders", fixup="prepended_image_placeholders")]


def _too_many_placeholders(ctx):
    row = _colour_task(ctx, k=1)
    row.conversation[0]["content"] = "<image><image>" + row.conversation[0]["content"]
    return [_mark(row, "too_many_placeholders", "reject:too_many_placeholders")]


def _missing_image(ctx):
    row = _colour_task(ctx)
    stem, ext = row.images[1].path.rsplit(".", 1)
    row.images[1] = _Img(f"{stem}_missing.{ext}", None)
    return [_mark(row, "missing_image", "reject:missing_image")]


def _undecodable_image(ctx):
    row = _colour_task(ctx, k=1)
    row.images[0].data = b"NOT AN IMAGE" + ctx.rng.randbytes(700)
    return [_mark(row, "undecodable_image", "reject:undecodable_image")]


def _images_none(ctx):
    row = _colour_task(ctx, k=1)
    row.images = None
    return [_mark(row, "images_none_with_placeholders", "reject:images_none_with_placeholders")]


def _unsafe_member(ctx):
    row = _colour_task(ctx, k=1, fmt="png")
    row.images[0].path = "../evil.png"
    return [_mark(row, "unsafe_member_name", "reject:unsafe_member_name")]


def _jpeg_named_png(ctx):
    return [_mark(_colour_task(ctx, k=2, fmt="jpeg", ext="png"), "jpeg_bytes_named_png")]


def _palette_and_rgba(ctx):
    a, shape_a, col_a = ctx.shape(fmt="png-palette")
    b, shape_b, col_b = ctx.shape(fmt="png-rgba")
    text = f"<image><image>What colours are the {shape_a} in image 1 and the {shape_b} in image 2?"
    row = _Row(ctx.row_id(), [a, b], _conv(text, f"{col_a} and {col_b}"))
    return [_mark(row, "palette_png_and_rgba_png")]


def _grayscale(ctx):
    return [_mark(_count_task(ctx, fmt="jpeg-gray"), "grayscale_jpeg")]


def _odd_ids(ctx):
    dotted = _mark(_colour_task(ctx), "id_with_dots_and_slashes")
    dotted.id = "a.b/c.1"
    dups = [_mark(_colour_task(ctx), "duplicate_id") for _ in range(2)]
    for row in dups:
        row.id = f"{ctx.config}_dup.0001"
    return [dotted, *dups]


def _text_only(ctx):
    rows = [_Row(ctx.row_id() + f"_text{k}", images, _conv("Say the word 'apple'.", "apple"))
            for k, images in enumerate((None, []))]
    return [_mark(row, "text_only_row") for row in rows]


def _tall_image(ctx):
    img = ctx.image(media.word_image("tall", (200, 6000)), "png")
    return [_mark(_Row(ctx.row_id(), [img], _conv("<image>What word is written here?", "tall")),
                  "tall_image_200x6000")]


def _huge_image(ctx):
    return [_mark(_count_task(ctx, size=(4000, 3000), n_images=1), "huge_image_4000x3000")]


def _fifty_images(ctx):
    return [_mark(_story_task(ctx, n=50), "fifty_images")]


#: pitfall -> (home config, builder); a pitfall whose home is not built goes to the first config.
PITFALLS: dict[str, tuple[str, Callable[[_Ctx], list[_Row]]]] = {
    "fewer_placeholders": ("birds-to-words", _fewer_placeholders),
    "jpeg_bytes_named_png": ("birds-to-words", _jpeg_named_png),
    "palette_and_rgba": ("birds-to-words", _palette_and_rgba),
    "too_many_placeholders": ("nlvr2", _too_many_placeholders),
    "missing_image": ("nlvr2", _missing_image),
    "odd_ids": ("nlvr2", _odd_ids),
    "undecodable_image": ("llava_665k_multi", _undecodable_image),
    "images_none_with_placeholders": ("llava_665k_multi", _images_none),
    "unsafe_member_name": ("llava_665k_multi", _unsafe_member),
    "text_only": ("llava_665k_multi", _text_only),
    "grayscale": ("llava_665k_multi", _grayscale),
    "tall_image": ("llava_665k_multi", _tall_image),
    "huge_image": ("llava_665k_multi", _huge_image),
    "fifty_images": ("visual_story_telling", _fifty_images),
}


def _rows(ctx: _Ctx, n: int, pitfall_fns: list) -> list[_Row]:
    task = TASKS.get(ctx.config, _colour_task)
    rows = [task(ctx) for _ in range(n)]
    for fn in pitfall_fns:
        for row in fn(ctx):
            rows.insert(ctx.rng.randrange(len(rows) + 1), row)
    return rows


def _write_split(cfg_dir: Path, config: str, split: str, rows: list[_Row], man: Manifest):
    table = [{"id": r.id, "source": config, "conversation": r.conversation,
              "images": None if r.images is None else
              [{"bytes": None, "path": i.path} for i in r.images]} for r in rows]
    write_parquet(cfg_dir / shard_names(split, 1)[0], table, _features(config),
                  hf_metadata=config in IMAGE_FEATURE_CONFIGS)
    members = list({i.path: i.data for r in rows for i in r.images or [] if i.data}.items())
    if config in PART_ZIP_CONFIGS and split == "train":
        half = (len(members) + 1) // 2
        names = [f"{split}_images_part{k}.zip" for k in (1, 2)]
        write_zip(cfg_dir / names[0], members[:half])
        write_zip(cfg_dir / names[1], members[half:])
        (cfg_dir / f"{split}_images_zips.txt").write_text("\n".join(names) + "\n")
    else:
        write_zip(cfg_dir / f"{split}_images.zip", members)
    key = f"{config}/{split}"
    man.rows[key] = len(rows)
    man.expected_samples[key] = sum(r.expect == "kept" for r in rows)
    for k, r in enumerate(rows):
        if r.expect != "kept":
            man.expected_rejects[r.expect.removeprefix("reject:")] += 1
        elif r.fixup:
            man.expected_fixups[r.fixup] += 1
        if r.pitfall:
            man.note(key, k, r.id, r.pitfall, f"fixup:{r.fixup}" if r.fixup else r.expect)


def build_mantis(root: Path, *, configs: dict[str, int] | None = None, pitfalls: bool = True,
                 seed: int = 0) -> Path:
    """Build a Mantis-Instruct lookalike under `root/Mantis-Instruct`.

    Args:
        root: Parent folder; `root/Mantis-Instruct` is replaced.
        configs: config name -> number of regular train rows (default `DEFAULT_CONFIGS`).
            Configs in `VAL_CONFIGS` also get a val split of max(2, n // 3) rows.
        pitfalls: Plant the pitfalls of `PITFALLS` in the train splits.
        seed: Everything is a function of the seed.

    Returns:
        The dataset root, to pass to `datasets.load_dataset(root, config, split=...)`.
    """
    configs = dict(configs or DEFAULT_CONFIGS)
    if not configs:
        raise ValueError("build_mantis: configs must name at least one config")
    out = fresh_dir(Path(root) / FOLDER)
    man, card, infos = Manifest(DATASET), {}, []
    homes = {name: home if home in configs else next(iter(configs))
             for name, (home, _) in PITFALLS.items()}
    for config, n in configs.items():
        splits = {"train": n, **({"val": max(2, n // 3)} if config in VAL_CONFIGS else {})}
        card[config] = {split: f"{config}/{split}-*" for split in splits}
        for split, n_rows in splits.items():
            ctx = _Ctx(random.Random(f"{DATASET}/{config}/{split}/{seed}"), config, split)
            fns = [PITFALLS[p][1] for p, home in homes.items()
                   if pitfalls and split == "train" and home == config]
            _write_split(out / config, config, split, _rows(ctx, n_rows, fns), man)
        files = {split: sorted((out / config).glob(f"{split}-*.parquet")) for split in splits}
        infos.append(card_info(config, _features(config), files))
    write_card(out, card, "Mantis-Instruct (local lookalike)",
               "Synthetic stand-in with the hub's schema and layout; see lookalike_manifest.json.",
               infos)
    man.write(out)
    return out
