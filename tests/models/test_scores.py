"""Scores on worked examples (ANLS, option letters, exact and relaxed match)."""

from __future__ import annotations

import pytest

from models.scores import (
    anls,
    anls_one,
    exact_match,
    levenshtein,
    option_accuracy,
    parse_option_letter,
    relaxed_match,
)


def test_levenshtein_worked_examples():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0


@pytest.mark.parametrize("pred, refs, expected", [
    ("Hello  World ", ["hello world"], 1.0),        # case and whitespace normalised
    ("helo world", ["hello world"], 1 - 1 / 11),    # one deletion in 11 characters
    ("abcde", ["abxde"], 0.8),                      # NL 0.2
    ("abcd", ["abxy"], 0.0),                        # NL 0.5 is not below the threshold
    ("abc", ["xyz"], 0.0),
    ("52%", ["fifty two", "52%"], 1.0),             # max over references
    ("", [""], 1.0),
])
def test_anls_one(pred, refs, expected):
    assert anls_one(pred, refs) == pytest.approx(expected)


def test_anls_mean_and_length_check():
    assert anls(["abcde", "abc"], [["abxde"], ["xyz"]]) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        anls(["a"], [])


OPTIONS = {"A": "right", "B": "left", "C": "up", "D": "down"}


@pytest.mark.parametrize("text, letter", [
    ("B", "B"), ("B.", "B"), ("(B)", "B"), ("B) left", "B"), ("The answer is B", "B"),
    ("Answer: C", "C"), ("answer is (d).", "D"), ("left", "B"), ("I think it is D.", "D"),
    ("Probably A or B", None), ("", None),
])
def test_parse_option_letter(text, letter):
    assert parse_option_letter(text, OPTIONS) == letter


def test_option_accuracy():
    assert option_accuracy(["B", "The answer is C", "x"], ["B", "A", "C"],
                           [OPTIONS] * 3) == pytest.approx(1 / 3)


@pytest.mark.parametrize("pred, refs, em, relaxed", [
    ("Yes.", ["yes"], 1.0, 1.0),
    ("10.4", ["10"], 0.0, 1.0),      # 4 % off: relaxed accuracy accepts
    ("11", ["10"], 0.0, 0.0),        # 10 % off
    ("1,200", ["1200"], 0.0, 1.0),
    ("the cat", ["cat"], 0.0, 0.0),
])
def test_exact_and_relaxed(pred, refs, em, relaxed):
    assert exact_match(pred, refs) == em and relaxed_match(pred, refs) == relaxed
