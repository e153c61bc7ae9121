"""Benchmark scores for generated answers, each from its published definition.

- `anls`: Average Normalized Levenshtein Similarity (Biten et al., ICCV 2019, the DocVQA /
  InfographicVQA metric): per question, the best over its reference answers of 1 - NL(pred, ref)
  when the normalised edit distance NL is below the 0.5 threshold, else 0; answers compared
  case-insensitively with surrounding and repeated whitespace removed.
- `parse_option_letter` + `option_accuracy`: multiple choice (LLaVA-Video), the option letter read
  from free text ("B", "B.", "(B)", "The answer is B", or the text of an option).
- `exact_match` and `relaxed_match`: Mantis subsets; relaxed is ChartQA's relaxed accuracy (a
  numeric answer within 5 % of the reference counts as correct, otherwise exact match).
Pure functions, no model or data dependencies.
"""

from __future__ import annotations

import re
import string

ANLS_THRESHOLD = 0.5
RELAXED_TOLERANCE = 0.05


def normalize_answer(text: str) -> str:
    """Lower case, surrounding / repeated whitespace removed (the ANLS normalisation)."""
    return " ".join(str(text).lower().split())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def anls_one(prediction: str, references: list[str], threshold: float = ANLS_THRESHOLD) -> float:
    """ANLS of one question: max over references of the thresholded similarity."""
    pred = normalize_answer(prediction)
    best = 0.0
    for reference in references:
        ref = normalize_answer(reference)
        longest = max(len(pred), len(ref))
        distance = levenshtein(pred, ref) / longest if longest else 0.0
        best = max(best, 1.0 - distance if distance < threshold else 0.0)
    return best


def anls(predictions: list[str], references: list[list[str]]) -> float:
    """Mean ANLS over questions (0 for an empty list)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} questions")
    scores = [anls_one(p, r) for p, r in zip(predictions, references)]
    return sum(scores) / len(scores) if scores else 0.0


_LEADING_LETTER = re.compile(r"^\s*[\(\[]?([A-Z])(?:[\)\]\.:,]|\s|$)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)?\s*[:\-]?\s*[\(\[]?([A-Z])\b(?:[\)\]\.:,]|\s|$)",
                        re.IGNORECASE)
_LONE_LETTER = re.compile(r"(?<![A-Za-z])[\(\[]?([A-Z])[\)\]\.]?(?![A-Za-z])")


def parse_option_letter(text: str, options: dict[str, str] | None = None) -> str | None:
    """The option letter a free-text answer chooses, or None.

    Tried in order: a leading letter ("B", "B.", "(B)", "B) left"), "the answer is B" /
    "Answer: B", the exact text of one option (when `options` maps letters to texts), and a
    single standalone capital letter among the valid ones.
    """
    valid = set(options) if options else set(string.ascii_uppercase)
    for pattern in (_LEADING_LETTER, _ANSWER_IS):
        match = pattern.search(text)
        if match and match.group(1).upper() in valid:
            return match.group(1).upper()
    if options:
        said = normalize_answer(text).strip(" .")
        chosen = [k for k, v in options.items() if normalize_answer(v).strip(" .") == said]
        if len(chosen) == 1:
            return chosen[0]
    lone = {m.group(1) for m in _LONE_LETTER.finditer(text) if m.group(1) in valid}
    return lone.pop() if len(lone) == 1 else None


def option_accuracy(predictions: list[str], answers: list[str],
                    options: list[dict[str, str] | None] | None = None) -> float:
    """Share of predictions whose parsed letter equals the reference letter."""
    options = options or [None] * len(predictions)
    hits = [parse_option_letter(p, o) == a.strip().upper()[:1]
            for p, a, o in zip(predictions, answers, options)]
    return sum(hits) / len(hits) if hits else 0.0


def _clean(text: str) -> str:
    return normalize_answer(text).strip(string.punctuation + " ")


def exact_match(prediction: str, references: list[str]) -> float:
    """1.0 when the normalised prediction equals a normalised reference."""
    return float(any(_clean(prediction) == _clean(r) for r in references))


def _number(text: str) -> float | None:
    try:
        return float(_clean(text).replace(",", "").rstrip("%"))
    except ValueError:
        return None


def relaxed_match(prediction: str, references: list[str],
                  tolerance: float = RELAXED_TOLERANCE) -> float:
    """ChartQA relaxed accuracy: numbers within `tolerance` relative error, else exact match."""
    pred = _number(prediction)
    for reference in references:
        ref = _number(reference)
        if pred is not None and ref is not None:
            if (ref == 0 and pred == 0) or (ref != 0 and abs(pred - ref) / abs(ref) <= tolerance):
                return 1.0
        elif _clean(prediction) == _clean(reference):
            return 1.0
    return 0.0
