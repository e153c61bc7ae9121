"""Benchmark scores for generated answers, each computed as the reference evaluation computes it.

- `anls_one` / `anls`: InfographicVQA's ANLS exactly as lmms-eval scores its ``infovqa_val`` task
  (lmms_eval/api/metrics.py ``anls`` with ``levenshtein_distance``, itself taken from Qwen-VL's
  ``eval_mm/infographicsvqa_eval.py``, the Robust Reading Competition script; unchanged from
  lmms-eval v0.3.0 to v0.7): the generated answer is first stripped (lmms-eval's
  ``ConfigurableTask.process_results``); per reference, the Levenshtein distance between the two
  strings lower-cased with surrounding and repeated whitespace removed, divided by the longer of
  the two *un-normalised* lengths (``len(s.upper())``: the stripped prediction, the reference as
  stored), 0 when both are empty; the question scores 1 - the smallest of these, or 0 when that is
  below 0.5 (exactly 0.5 is kept). Differences from Biten et al. 2019: docs/evaluation.md.
- `extract_option_letter` (+ `option_letters`): the letter a multiple-choice output chooses, by
  the rule of lmms-eval's Video-MME task (lmms_eval/tasks/videomme/utils.py
  ``extract_characters_regex`` as of v0.3.0, the version the LLaVA-Video authors scored with):
  a few answer prefixes are deleted, then the first capital option letter anywhere in the text.
- `answer_letter`: the option a reference answer names (``E. training.``, ``E``, ``(E)`` or the
  text of one option).
- `exact_match` and `relaxed_match`: Mantis subsets; relaxed is ChartQA's relaxed accuracy (a
  numeric answer within 5 % of the reference counts as correct, otherwise exact match).
- `parse_options`, `score_answer`, `aggregate`: how eval.py scores one generated answer (the
  metric follows the dataset and the question's form) and averages the scores per subset, per
  dataset and overall.
Pure functions, no model or data dependencies.
"""

from __future__ import annotations

import re
import string
from collections import defaultdict

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
    """ANLS of one question, as lmms-eval's InfoVQA task scores it (see the module docstring).

    Raises:
        ValueError: no reference answer.
    """
    if not references:
        raise ValueError("ANLS needs at least one reference answer")
    said = prediction.strip()  # lmms-eval strips every generated answer before scoring it
    distances = []
    for reference in references:
        longest = max(len(reference.upper()), len(said.upper()))  # un-normalised lengths
        edits = levenshtein(normalize_answer(reference), normalize_answer(said))
        distances.append(edits / longest if longest else 0.0)
    score = 1.0 - min(distances)
    return score if score >= threshold else 0.0


def anls(predictions: list[str], references: list[list[str]]) -> float:
    """Mean ANLS over questions (0 for an empty list)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} questions")
    scores = [anls_one(p, r) for p, r in zip(predictions, references)]
    return sum(scores) / len(scores) if scores else 0.0


# Video-MME's prefixes as Python reads its list: two commas are missing there, so the 5th and 6th
# entries are two phrases run together, and "The best option is" / "Best answer:" are never
# deleted. The deletions matter only through capital letters: "Best answer:" left in gives "B".
_VIDEOMME_PREFIXES = ("The best answer is", "The correct answer is", "The answer is", "The answer",
                      "The best option isThe correct option is", "Best answer:Best option:")
VIDEOMME_LETTERS = "ABCD"


def option_letters(options) -> str:
    """The letters `extract_option_letter` looks for: Video-MME's A-D, up to E for 5 options."""
    last = max("D", *options)
    return string.ascii_uppercase[: string.ascii_uppercase.index(last) + 1]


def extract_option_letter(output: str, letters: str = VIDEOMME_LETTERS) -> str:
    """The option letter a generated answer chooses ("" for none), by Video-MME's rule.

    lmms-eval ``videomme/utils.py::extract_characters_regex`` (v0.3.0): delete each answer
    prefix ("The best answer is", "The answer is", ...) wherever it occurs, then take the first
    character of the class ``[ABCD]`` anywhere in the text. Case-sensitive throughout: "e" or
    "The answer is c" choose nothing, "Based on the video, E" chooses B. (Its extra check, more
    than ten words and no letter -> "", gives "" exactly when the search finds nothing anyway.)
    The one change: `letters` widens the class to the options a question lists (A-E for
    LLaVA-Video's five-option questions, `option_letters`); with A-D it is the original.
    """
    for prefix in _VIDEOMME_PREFIXES:
        output = output.replace(prefix, "")
    return next((ch for ch in output if ch in letters), "")


_ANSWER_LETTER = re.compile(r"\s*(?:\(([A-Z])\)|([A-Z])(?:[.:)]|\s*$))")


def answer_letter(answer: str, options: dict[str, str]) -> str | None:
    """The option a reference answer names, or None when it names none of `options`.

    Its leading capital letter followed by ".", ":", ")" or nothing ("E. training.", "E",
    "E) training"), or in brackets ("(E) training"); otherwise the one option whose text it
    repeats (compared like `exact_match`: "Training" names "E" when E is "training.").
    """
    match = _ANSWER_LETTER.match(answer)
    if match:
        letter = match.group(1) or match.group(2)
        return letter if letter in options else None
    named = [letter for letter, text in options.items() if _clean(text) == _clean(answer)]
    return named[0] if len(named) == 1 else None


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


# ------------------------------------------------------------------ eval.py's scoring
_OPTION_LINE = re.compile(r"\s*\(?([A-Z])[.)]\s+(.+?)\s*$")


def parse_options(question: str) -> dict[str, str] | None:
    """The options a multiple-choice question lists, {letter: text}, or None.

    LLaVA-Video's form: an "Options:" line, then one "A. text" line per option (up to E), then the
    instruction ("Please provide your answer by stating the letter followed by the full
    option."): the option lines right after the last "Options:" line are read. Without that line,
    option lines ("A. text", "(B) text", "C) text") anywhere in the question. None when there are
    fewer than two or the letters are not A, B, C, ... in order.
    """
    lines = question.splitlines()
    headers = [i for i, line in enumerate(lines) if line.strip().lower() == "options:"]
    if headers:
        matches = []
        for line in lines[headers[-1] + 1:]:
            if not (match := _OPTION_LINE.match(line)):
                break
            matches.append(match)
    else:
        matches = [m for m in map(_OPTION_LINE.match, lines) if m]
    letters = [m.group(1) for m in matches]
    if len(letters) < 2 or letters != [chr(ord("A") + i) for i in range(len(letters))]:
        return None
    return {m.group(1): m.group(2) for m in matches}


def score_answer(dataset: str, question: str, prediction: str, references: list[str]
                 ) -> tuple[str, dict[str, float]]:
    """(primary metric name, {metric: value}) of one generated answer.

    InfoVQA: ANLS. A question listing options whose reference names one of them ("E. training.",
    "E", the option's text): option accuracy, the letter read from the answer by lmms-eval
    Video-MME's rule (``extract_option_letter``). Everything else: exact and relaxed
    match.
    """
    if dataset == "infovqa":
        return "anls", {"anls": anls_one(prediction, references)}
    options = parse_options(question)
    letter = answer_letter(references[0], options) if options else None
    if letter is not None:
        chosen = extract_option_letter(prediction, option_letters(options))
        return "option_acc", {"option_acc": float(chosen == letter)}
    return "exact", {"exact": exact_match(prediction, references),
                     "relaxed": relaxed_match(prediction, references)}


def aggregate(records: list[dict]) -> dict:
    """Mean of every metric and of the primary score, per subset, per dataset and overall."""
    groups: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for name in (r["subset"], r["dataset"], "overall"):
            groups[name]["score"].append(r["score"])
            for metric, value in r["scores"].items():
                groups[name][metric].append(value)

    def summary(values: dict[str, list]) -> dict:
        return {"n": len(values["score"]),
                **{k: sum(v) / len(v) for k, v in sorted(values.items())}}

    datasets = sorted({r["dataset"] for r in records})
    subsets = sorted({r["subset"] for r in records})
    return {"overall": summary(groups["overall"]),
            "datasets": {d: summary(groups[d]) for d in datasets},
            "subsets": {s: summary(groups[s]) for s in subsets}}
