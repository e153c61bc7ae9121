"""Ahren09/InfoVQA (high-resolution infographics) -> canonical samples.

Accepts the Ahren09 spelling (`image`, `question`, `answer`: list) and the lmms-lab/DocVQA
`InfographicVQA` spelling (`questionId`, `question`, `answers`, ...). The ~5 questions that share
one infographic become ONE multi-turn sample, so the image is stored and later encoded once
(`one_question_per_sample=True` turns this off); rows are grouped by a hash of the image bytes,
in order of first appearance. Rows without answers (the test split) are rejected with reason
`no_answer`; a question or answer that contains a media placeholder (`<image>` / `<video>`) as
text is rejected `placeholder_in_text` (it would be read as a second image). Images keep their
original bytes and resolution (resizing is the loader's job) once they decode within the pixel
cap. A split without the image / question / answer columns is a one-line error before any shard.
"""

from __future__ import annotations

import hashlib

import datasets

from contract.console import phase
from converters.base import Built, Reject, SourceSplit, Unit, reject_all, row_id
from converters.hub import Source, open_splits, resolve_configs
from converters.media import DEFAULT_LIMITS, Limits, MediaError, image_media, probe_image
from energon_tasks.sample_format import (
    IMAGE_PLACEHOLDER,
    PLACEHOLDER_RE,
    CanonicalSample,
    SourceRef,
    Turn,
    sample_key,
)

HUB_ID = "Ahren09/InfoVQA"
DATASET = "infovqa"
REQUIRED_COLUMNS = ({"image"}, {"question"}, {"answer", "answers"})
INFOGRAPHIC_CONFIG = "InfographicVQA"  #: lmms-lab/DocVQA's config of this dataset


def _no_train_line(source: Source, splits: list[SourceSplit]) -> str:
    """One line for a source that declares no train split (lmms-lab/DocVQA's card comments its
    train entry out): where its rows go, and which source to train on."""
    went = ", ".join(f"{s.split} ({s.num_rows} rows) -> {s.target}" for s in splits)
    return (f"note: {source.location} declares no train split ({went}; test rows have no "
            f"answers and are rejected no_answer): this gives evaluation data only; to train, "
            f"convert {HUB_ID}")

def _answers(row: dict) -> list[str]:
    value = row.get("answer", row.get("answers"))
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        return []
    return [a.strip() for a in value if isinstance(a, str) and a.strip()]


def _image_digests(table: datasets.Dataset) -> list[str]:
    """BLAKE2 of each row's image bytes, read from the Arrow column without decoding (a row
    without bytes gets a digest of its own: it is never grouped with another)."""
    digests = []
    for chunk in table.data.column("image").chunks:
        for data in chunk.field("bytes").to_pylist():
            digest = hashlib.blake2b(data or b"", digest_size=16).hexdigest()
            digests.append(digest if data else f"{digest[:16]}{len(digests):016x}")
    return digests


def _row_problem(question, answers: list[str]) -> tuple[str, str] | None:
    """(reason, detail) when a row cannot become a turn pair."""
    if not answers:
        return "no_answer", "no answers"
    if not isinstance(question, str) or not question.strip():
        return "bad_conversation", "no question"
    for text in (question, *answers):
        if PLACEHOLDER_RE.search(text):
            return "placeholder_in_text", f"{text[:80]!r} contains a media placeholder"
    return None


class InfoVQASource:
    """InfoVQA opened for conversion (see module docstring)."""

    name = DATASET

    def __init__(self, source: Source, configs: list[str] | None = None,
                 splits: list[str] | None = None, one_question_per_sample: bool = False,
                 limits: Limits = DEFAULT_LIMITS):
        self.source = source
        self.limits = limits
        self.one_question_per_sample = one_question_per_sample
        self.configs = resolve_configs(source, configs or self._default_configs(source))

        def load(config, split):
            table = source.load(config, split)
            return table.cast_column("image", datasets.Image(decode=False))

        self._splits, self._tables = open_splits(source, self.configs, splits, load,
                                                 required=REQUIRED_COLUMNS)
        if not any(s.target in ("train", "carve") for s in self._splits):
            phase(_no_train_line(source, self._splits))

    @staticmethod
    def _default_configs(source: Source) -> list[str] | None:
        """lmms-lab/DocVQA holds document VQA too: only its InfographicVQA config by default."""
        names = source.config_names()
        return [INFOGRAPHIC_CONFIG] if INFOGRAPHIC_CONFIG in names and len(names) > 1 else None

    def fingerprint(self) -> dict:
        return {**self.source.fingerprint(), "configs": self.configs,
                "one_question_per_sample": self.one_question_per_sample,
                "limits": self.limits.fingerprint()}

    def splits(self) -> list[SourceSplit]:
        return self._splits

    def units(self, split: SourceSplit) -> list[Unit]:
        table = self._tables[(split.config, split.split)]
        digests = _image_digests(table)
        if "questionId" in table.column_names:
            questions = (table.data.column("question").to_pylist()
                         if "question" in table.column_names else [None] * len(table))
            made = [row_id(value, row, [digests[row], questions[row]]) for row, value in
                    enumerate(table.data.column("questionId").to_pylist())]
            ids, from_row = [m[0] for m in made], [m[1] for m in made]
        else:
            ids = [f"{split.split}-{row}" for row in range(len(table))]
            from_row = [False] * len(table)
        if self.one_question_per_sample:
            groups = {row: [row] for row in range(len(table))}
        else:
            groups: dict[str, list[int]] = {}
            for row, digest in enumerate(digests):
                groups.setdefault(digest, []).append(row)
        return [Unit(key=sample_key(DATASET, split.config, split.split, rows[0],
                                    f"info_{digests[rows[0]]}"),
                     rows=rows, ids=[ids[r] for r in rows],
                     ids_from_row=sum(from_row[r] for r in rows)) for rows in groups.values()]

    def build(self, split: SourceSplit, unit: Unit) -> Built:
        table = self._tables[(split.config, split.split)]
        rows = [table[r] for r in unit.rows]
        rejects, kept, turns = [], [], []
        for row_index, source_id, row in zip(unit.rows, unit.ids, rows):
            answers = _answers(row)
            question = row.get("question")
            problem = _row_problem(question, answers)
            if problem:
                rejects.append(Reject(id=source_id, config=split.config, split=split.split,
                                      row=row_index, reason=problem[0], detail=problem[1]))
                continue
            prefix = f"{IMAGE_PLACEHOLDER}\n" if not turns else ""
            turns.append(Turn(role="user", content=prefix + question.strip()))
            turns.append(Turn(role="assistant", content=answers[0], answers=answers))
            kept.append((row_index, source_id))
        if not kept:
            return Built(rejects=rejects)
        image = rows[0]["image"] or {}
        name = image.get("path") or f"{unit.ids[0]}.jpg"
        kept_unit = Unit(key=unit.key, rows=[r for r, _ in kept], ids=[i for _, i in kept])
        if not image.get("bytes"):
            return Built(rejects=rejects + reject_all(split, kept_unit, "missing_image",
                                                      f"{name}: no image bytes").rejects)
        try:
            probed = probe_image(image["bytes"], name, self.limits)
        except MediaError as err:
            return Built(rejects=rejects + reject_all(split, kept_unit, err.reason,
                                                      err.detail).rejects)
        entry, data = image_media(0, probed, name)
        sample = CanonicalSample(
            dataset=DATASET,
            source=SourceRef(config=split.config, split=split.split,
                             ids=[i for _, i in kept], rows=[r for r, _ in kept]),
            conversation=turns,
            media=[entry],
            fixups=["reencoded_image"] if probed.reencoded_from else [],
        )
        return Built(sample=sample, parts={entry.part: data}, rejects=rejects)
