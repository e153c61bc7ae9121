"""Local lookalike of InfographicVQA, in the Ahren09/InfoVQA or the lmms-lab/DocVQA spelling.

Owns both layouts and the infographics behind them. Ahren09: `data/{train,val,test}-*.parquet`
with columns image (HF `Image()`, JPEG bytes embedded, path null), question, answer (list; empty
or null on test). lmms-lab: config `InfographicVQA`, `InfographicVQA/{validation,test}-*.parquet`
with questionId, question, answers, answer_type, image, image_url, operation/reasoning, ocr,
data_split. Each infographic is rendered text (title, facts with numbers, bars) in several font
sizes, asked about by 3-6 questions whose answers are printed on it; its rows are repeated with
the same image bytes and are not always consecutive.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from datasets import Features, Image, List, Value

from . import media
from .files import Manifest, card_info, fresh_dir, shard_names, write_card, write_parquet

DATASET = "infovqa"
SPELLINGS = {"ahren09": ("InfoVQA", "default"), "lmms-lab": ("DocVQA", "InfographicVQA")}
TOPICS = ("Coffee", "Cycling", "Solar power", "Public libraries", "Rainfall", "Recycling",
          "Tourism", "Chess clubs", "Street trees", "Night trains")
CITIES = ("Oslo", "Lima", "Perth", "Quito", "Accra", "Hanoi", "Porto", "Dakar", "Cusco", "Turku")
AHREN09 = Features({"image": Image(), "question": Value("string"),
                    "answer": List(Value("string"))})
LMMS = Features({
    "questionId": Value("string"), "question": Value("string"),
    "answers": List(Value("string")), "answer_type": List(Value("string")),
    "image": Image(), "image_url": Value("string"),
    "operation/reasoning": List(Value("string")), "ocr": Value("string"),
    "data_split": Value("string"),
})


@dataclass
class _Page:
    name: str
    size: tuple[int, int]
    jpeg: bytes
    lines: list[str]  #: printed text, top to bottom (title first)
    qas: list[tuple[str, list[str], str]]  #: (question, reference answers, answer type)


def _facts(rng: random.Random, topic: str) -> list[tuple[str, str, list[str], str]]:
    """(printed line, question, answers, answer type) for one infographic."""
    year, asked, pct = rng.randint(1990, 2023), rng.randint(1200, 98000), rng.randint(5, 95)
    city, clubs = rng.choice(CITIES), rng.randint(3, 40)
    cost = rng.randint(2, 60) + rng.choice((0, 0.5))
    t = topic.lower()
    return [
        (f"Survey year: {year}", f"In which year was the {t} survey done?", [str(year)],
         "single span"),
        (f"People asked: {asked:,}", "How many people were asked?", [f"{asked:,}", str(asked)],
         "single span"),
        (f"{pct}% say they enjoy {t}", f"What percentage of people enjoy {t}?",
         [f"{pct}%", str(pct), f"{pct} percent"], "single span"),
        (f"Top city: {city}", "Which city ranks first?", [city], "single span"),
        (f"Average cost: ${cost:.2f}", "What is the average cost?", [f"${cost:.2f}",
         f"{cost:.2f}"], "single span"),
        (f"Clubs founded: {clubs}", "How many clubs were founded?", [str(clubs)],
         "single span"),
    ]


def _page(rng: random.Random, k: int, kind: str) -> _Page:
    """Render infographic `k`; kind is normal, tall (600x2400) or large (3000x4500)."""
    size = {"tall": (600, 2400), "large": (3000, 4500)}.get(kind)
    size = size or (2 * rng.randint(300, 500), 2 * rng.randint(250, 700))
    topic = TOPICS[k % len(TOPICS)]
    title = f"{topic} in {rng.choice(CITIES)}"
    facts = rng.sample(_facts(rng, topic), rng.randint(4, 6))
    w = size[0]
    lines = [(title, max(14, w // 14))] + [(f[0], rng.randint(max(10, w // 45), w // 18))
                                           for f in facts]
    quality = 50 if kind == "large" else 75
    jpeg = media.encode_image(media.text_page(size, lines), "jpeg", quality=quality)
    qas = [("What is the title of the infographic?", [title, title.lower()], "question span")]
    qas += [(q, a, typ) for _, q, a, typ in facts]
    qas = rng.sample(qas, min(len(qas), rng.randint(3, 6)))
    return _Page(f"infographic_{k:04d}", size, jpeg, [t for t, _ in lines], qas)


def _rows(rng: random.Random, pages: list[_Page], shuffle: bool) -> list[tuple[_Page, int]]:
    """(page, qa index) rows in page order; `shuffle` lets neighbouring pages interleave."""
    rows = [(p, i, rng.uniform(0, 1.6) if shuffle else 0)
            for p in pages for i in range(len(p.qas))]
    order = {id(p): k for k, p in enumerate(pages)}
    rows.sort(key=lambda r: order[id(r[0])] + r[2])
    return [(p, i) for p, i, _ in rows]


def _ahren09_row(page: _Page, i: int, split: str, n: int) -> dict:
    question, answers, _ = page.qas[i]
    answer = answers if split != "test" else (None if n % 3 == 2 else [])
    return {"image": {"bytes": page.jpeg, "path": None}, "question": question, "answer": answer}


def _lmms_row(page: _Page, i: int, split: str, n: int) -> dict:
    question, answers, kind = page.qas[i]
    test = split == "test"
    return {
        "questionId": str(n), "question": question,
        "answers": None if test else answers, "answer_type": None if test else [kind],
        "image": {"bytes": page.jpeg, "path": None},
        "image_url": f"https://infographics.example.org/{page.name}.jpg",
        "operation/reasoning": None if test or kind != "single span" else ["Counting"],
        "ocr": json.dumps([{"text": t} for t in page.lines]),
        "data_split": "val" if split == "validation" else split,
    }


def _note_pages(man: Manifest, key: str, rows: list[tuple[_Page, int]], kinds: dict) -> None:
    first = {}
    for k, (page, _) in enumerate(rows):
        first.setdefault(page.name, k)
    for name, kind in kinds.items():
        if name in first:
            man.note(key, first[name], None, f"{kind}_image_{name}", "kept")
    names = [p.name for p, _ in rows]
    runs = sum(1 for k, n in enumerate(names) if k == 0 or n != names[k - 1])
    if runs > len(first):
        man.note(key, None, None, "rows_of_one_image_not_consecutive", "kept")


def build_infovqa(root: Path, *, spelling: str = "ahren09", n_images: int = 12,
                  pitfalls: bool = True, seed: int = 0) -> Path:
    """Build an InfographicVQA lookalike under `root/InfoVQA` (or `root/DocVQA` for lmms-lab).

    Args:
        root: Parent folder; the dataset folder is replaced.
        spelling: "ahren09" (splits train/val/test, config `default`) or "lmms-lab" (config
            `InfographicVQA`, splits validation/test, richer columns).
        n_images: Number of distinct infographics over all splits (>= 3); test gets
            max(1, n_images // 6), so does val (ahren09), train/validation the rest.
        pitfalls: Add one large 3000x4500 infographic and interleave the rows of neighbouring
            images; tall 600x2400 ones, multiple reference answers and answerless test rows
            are part of the schema and always present.
        seed: Everything is a function of the seed.

    Returns:
        The dataset root, to pass to `datasets.load_dataset(root, config, split=...)`.
    """
    if spelling not in SPELLINGS:
        raise ValueError(f"build_infovqa: spelling must be one of {sorted(SPELLINGS)}")
    if n_images < 3:
        raise ValueError(f"build_infovqa: n_images must be >= 3, got {n_images}")
    folder, config = SPELLINGS[spelling]
    out = fresh_dir(Path(root) / folder)
    rng = random.Random(f"{DATASET}/{seed}")
    kinds = {k: "large" if (k == 0 and pitfalls) else "tall" if k % 4 == 1 else "normal"
             for k in range(n_images)}
    pages = [_page(rng, k, kind) for k, kind in kinds.items()]
    k_test = max(1, n_images // 6)
    if spelling == "ahren09":
        cut = [n_images - 2 * k_test, n_images - k_test]
        splits = {"train": pages[:cut[0]], "val": pages[cut[0]:cut[1]], "test": pages[cut[1]:]}
    else:
        splits = {"validation": pages[:-k_test], "test": pages[-k_test:]}
    man, card, files = Manifest(DATASET), {config: {}}, {}
    prefix = "data" if spelling == "ahren09" else config
    make, features = (_ahren09_row, AHREN09) if spelling == "ahren09" else (_lmms_row, LMMS)
    special = {p.name: kinds[k] for k, p in enumerate(pages) if kinds[k] != "normal"}
    for s_idx, (split, split_pages) in enumerate(splits.items()):
        rows = _rows(rng, split_pages, shuffle=pitfalls)
        base = 10000 * (s_idx + 1)  # row number, unique over splits (lmms-lab questionId)
        table = [make(page, i, split, base + n) for n, (page, i) in enumerate(rows)]
        n_shards = 2 if split == "train" and len(table) > 1 else 1
        bounds = [len(table) * s // n_shards for s in range(n_shards + 1)]
        files[split] = [out / prefix / name for name in shard_names(split, n_shards)]
        for s, path in enumerate(files[split]):
            write_parquet(path, table[bounds[s]:bounds[s + 1]], features, hf_metadata=True)
        card[config][split] = f"{prefix}/{split}-*"
        key = f"{config}/{split}"
        man.rows[key] = len(rows)
        man.expected_samples[key] = 0 if split == "test" else len(split_pages)
        _note_pages(man, key, rows, special)
        if split == "test":
            man.expected_rejects["no_answer"] += len(rows)
            man.note(key, None, None, "test_rows_without_answers", "reject:no_answer")
        elif any(len(page.qas[i][1]) > 1 for page, i in rows):
            man.note(key, None, None, "several_reference_answers", "kept")
    write_card(out, card, f"InfographicVQA, {spelling} spelling (local lookalike)",
               "Synthetic stand-in with the hub's schema and layout; see lookalike_manifest.json.",
               [card_info(config, features, files)])
    if spelling == "lmms-lab":
        _undeclared_train(out, config, rng, features)
        man.note(f"{config}/train", None, None, "train_files_present_but_commented_out_in_card",
                 "ignored")
    man.write(out)
    return out


def _undeclared_train(out: Path, config: str, rng: random.Random, features) -> None:
    """As on the hub: train parquet files exist, but the card's train entry is commented out."""
    pages = [_page(rng, 100 + k, "normal") for k in range(2)]
    rows = [_lmms_row(page, i, "train", 90000 + n) for n, (page, i) in
            enumerate(_rows(rng, pages, shuffle=False))]
    write_parquet(out / config / shard_names("train", 1)[0], rows, features, hf_metadata=True)
    card = (out / "README.md").read_text(encoding="utf-8")
    entry = f"  - split: validation\n    path: {config}/validation-*\n"
    commented = f"  # - split: train\n  #   path: {config}/train-*\n"
    (out / "README.md").write_text(card.replace(entry, commented + entry, 1), encoding="utf-8")
