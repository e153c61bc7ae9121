"""Scores on tables worked out by hand from the reference definitions (recipes/scores.py).

ANLS (lmms-eval's InfoVQA task): the prediction is stripped; per reference
    NL = lev(norm(ref), norm(pred)) / L,  L = max(len(ref.upper()), len(pred.upper()))
with norm = lower case, surrounding / repeated whitespace removed, and L taken over the strings
*before* norm (the stripped prediction, the reference as stored); NL = 0 when L = 0. The question
scores s = 1 - min NL over its references, or 0 when s < 1/2 (s = 1/2 is kept).
Each expected value below is a fraction written by hand from that definition, with its working.

Multiple choice (lmms-eval Video-MME's ``extract_characters_regex``): answer prefixes deleted,
then the first capital among the question's letters (A-D, up to E for five options) anywhere.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from recipes.scores import (
    anls,
    anls_one,
    answer_letter,
    exact_match,
    extract_option_letter,
    levenshtein,
    option_letters,
    relaxed_match,
)

COCA = ["Coca Cola", "Coca Cola Company"]

# (prediction, references, expected ANLS, working: d = edits on normalised strings, L as above)
ANLS_TABLE = [
    # the Robust Reading Competition's own example (same answers, same scores)
    ("Coca Cola", COCA, "1", "d=0"),
    ("coca cola", COCA, "1", "case ignored, d=0"),
    ("CocaCola", COCA, "8/9", "d=1, L=9; vs 'Coca Cola Company' d=9, L=17: 8/17 < 1/2"),
    ("The Coca", COCA, "0", "d=5 ('the'->'coc', +'a', 'c'->'l'), L=9: 4/9 < 1/2"),
    ("Cola", COCA, "0", "d=5 ('coca ' inserted), L=9: 4/9 < 1/2"),
    ("Cat", COCA, "0", "d>=6 (9-3 insertions at least), L=9"),
    # surrounding / inner whitespace: removed before the distance, counted in L
    ("  Coca   Cola  ", ["Coca Cola"], "1", "d=0"),
    ("Coca   Cola!", ["Coca Cola"], "11/12", "d=1 ('!'), L=len('Coca   Cola!')=12 (not 10)"),
    ("a  b", ["ab"], "3/4", "norm 'a b' vs 'ab': d=1, L=len('a  b')=4"),
    ("new  york", ["New York"], "1", "inner spaces collapsed, d=0"),
    ("new\tyork\n", ["New York"], "1", "tab / newline are whitespace, d=0"),
    ("newyork", ["New York"], "7/8", "d=1, L=8"),
    ("43", [" 42 "], "3/4", "reference not stripped for L: d=1, L=len(' 42 ')=4"),
    ("abc", ["abd   "], "5/6", "d=1, L=len('abd   ')=6"),
    ("abd   ", ["abc"], "2/3", "prediction stripped first: d=1, L=3"),
    ("   ", [""], "1", "prediction stripped to '', L=0: NL=0"),
    ("", ["   "], "1", "norm both '', d=0, L=3: NL=0"),
    ("x", ["  "], "1/2", "norm '' vs 'x': d=1, L=len('  ')=2"),
    # empty strings
    ("", [""], "1", "L=0: NL=0"),
    ("", ["abc"], "0", "d=3, L=3"),
    ("abc", [""], "0", "d=3, L=3"),
    ("", ["a"], "0", "d=1, L=1"),
    # threshold: exactly 1/2 is kept, below is 0
    ("43", ["42"], "1/2", "d=1, L=2"),
    ("abcd", ["abxy"], "1/2", "d=2, L=4"),
    ("ab", ["abcd"], "1/2", "d=2, L=4"),
    ("abcdef", ["abc"], "1/2", "d=3, L=6"),
    ("flaw", ["lawn"], "1/2", "d=2 (-f, +n), L=4"),
    ("york", ["New York"], "1/2", "d=4 ('new '), L=8"),
    ("a", ["ab"], "1/2", "d=1, L=2"),
    ("ab", ["a"], "1/2", "d=1, L=2"),
    ("abcdefg", ["abc"], "0", "d=4, L=7: 3/7 < 1/2"),
    ("abc", ["abxyz"], "0", "d=3, L=5: 2/5 < 1/2"),
    ("ork", ["New York"], "0", "d=5, L=8: 3/8 < 1/2"),
    ("a", ["abc"], "0", "d=2, L=3: 1/3 < 1/2"),
    # partial credit above the threshold
    ("helo world", ["hello world"], "10/11", "d=1, L=11"),
    ("kitten", ["sitting"], "4/7", "d=3, L=7"),
    ("sitting", ["kitten"], "4/7", "symmetric"),
    ("abcde", ["abxde"], "4/5", "d=1, L=5"),
    ("abcdefghij", ["abcdefghxy"], "4/5", "d=2, L=10"),
    ("new york city", ["New York"], "8/13", "d=5 (' city'), L=13"),
    ("Yes.", ["yes"], "3/4", "punctuation counts: d=1, L=4"),
    ("YES", ["yes"], "1", "d=0"),
    ("83,098", ["83098"], "5/6", "d=1, L=6"),
    ("2018", ["2017", "2019"], "3/4", "d=1, L=4 for both"),
    # several references: the best one
    ("52%", ["fifty two", "52%"], "1", "second reference d=0"),
    ("52", ["52%", "fifty-two percent"], "2/3", "d=1, L=3; second far"),
    ("1,200", ["1200", "1,200 people"], "4/5", "d=1, L=5; vs '1,200 people' d=7, L=12: 5/12"),
    ("1,200 people", ["1200", "1,200 people"], "1", "second reference d=0"),
    ("83098 ", ["83,098", "83098"], "1", "stripped, second reference d=0"),
    ("cat", ["bat", "cab"], "2/3", "d=1, L=3 for both"),
    ("PARIS", ["paris", "Paris, France"], "1", "first reference d=0"),
    ("3 million", ["3 million.", "3,000,000"], "9/10", "d=1, L=10; vs '3,000,000' d>=7"),
    ("yes", ["no", "never"], "0", "vs 'no' d=3, L=3; vs 'never' d=4, L=5: 1/5"),
    # unicode: lower() for the distance, upper() for L, no NFC normalisation
    ("ÉCOLE", ["école"], "1", "'ÉCOLE'.lower() == 'école', d=0"),
    ("ecole", ["école"], "4/5", "d=1, L=5"),
    ("e\u0301cole", ["école"], "2/3", "decomposed e + U+0301 vs é: d=2, L=6"),
    ("s", ["ß"], "1/2", "d=1, L=len('ß'.upper()='SS')=2 (len('ß') would give 0)"),
    ("strasse", ["Straße"], "5/7", "d=2 (ß->s, +s), L=len('STRASSE')=7 on both sides"),
    ("straße", ["Straße"], "1", "d=0"),
    ("i", ["İ"], "0", "'İ'.lower() is 'i' + U+0307 (2 chars): d=1, L=1"),
    ("new\u00a0york", ["New York"], "1", "no-break space is whitespace, d=0"),
    ("北京市", ["北京"], "2/3", "d=1, L=3"),
    ("👍", ["👍"], "1", "d=0"),
]


def test_anls_table_size():
    assert len(ANLS_TABLE) >= 50


@pytest.mark.parametrize("pred, refs, expected, working", ANLS_TABLE,
                         ids=[f"{i}:{row[0]!r}" for i, row in enumerate(ANLS_TABLE)])
def test_anls_one_table(pred, refs, expected, working):
    assert anls_one(pred, refs) == pytest.approx(float(Fraction(expected)), abs=1e-12), working


def test_anls_mean_and_bad_input():
    # (8/9 + 0 + 1/2) / 3 = 25/54
    assert anls(["CocaCola", "Cat", "43"], [COCA, COCA, ["42"]]) == pytest.approx(25 / 54)
    assert anls([], []) == 0.0
    with pytest.raises(ValueError):
        anls(["a"], [])
    with pytest.raises(ValueError, match="at least one reference"):
        anls_one("a", [])


def test_levenshtein_worked_examples():
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("sitting", "kitten") == 3
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0
    assert levenshtein("the coca", "coca cola") == 5


# ------------------------------------------------------------------ multiple choice
FIVE = {"A": "running.", "B": "swimming.", "C": "cooking.", "D": "dancing.", "E": "training."}
FOUR = {"A": "running.", "B": "swimming.", "C": "cooking.", "D": "dancing."}
THREE = {"A": "running.", "B": "swimming.", "C": "cooking."}
ANSWER = {"ABCDE": "E. training.", "ABCD": "D. dancing."}

# (model output, letters looked for, extracted letter, correct against ANSWER[letters], why)
MC_TABLE = [
    # the answer form of LLaVA-Video-178K, and its usual variants
    ("E. training.", "ABCDE", "E", True, "the dataset's own answer form"),
    ("E. Training.", "ABCDE", "E", True, ""),
    ("\nE. training.\n", "ABCDE", "E", True, "surrounding whitespace"),
    ("E", "ABCDE", "E", True, "bare letter"),
    ("E.", "ABCDE", "E", True, ""),
    ("(E)", "ABCDE", "E", True, "bracketed"),
    ("(E) training", "ABCDE", "E", True, ""),
    ("E) training", "ABCDE", "E", True, ""),
    ("E: training", "ABCDE", "E", True, ""),
    ("[E]", "ABCDE", "E", True, ""),
    ("**E**", "ABCDE", "E", True, "markdown bold"),
    ("<E>", "ABCDE", "E", True, ""),
    ("E. running.", "ABCDE", "E", True, "the letter counts, not the option text after it"),
    ("A. training.", "ABCDE", "A", False, "the letter counts, not the option text after it"),
    # answer phrases
    ("The answer is E.", "ABCDE", "E", True, "prefix deleted (no capital A-E in it anyway)"),
    ("The answer is E. training.", "ABCDE", "E", True, ""),
    ("The correct answer is (E).", "ABCDE", "E", True, ""),
    ("The best answer is E", "ABCDE", "E", True, ""),
    ("The best option is E", "ABCDE", "E", True, "not deleted, but no capital A-E before E"),
    ("The answer isE", "ABCDE", "E", True, ""),
    ("answer: E", "ABCDE", "E", True, ""),
    ("Option E", "ABCDE", "E", True, "'O' is no option letter"),
    ("OPTION E", "ABCDE", "E", True, "O, P, T, I, N are no option letters"),
    ("Final answer: E", "ABCDE", "E", True, "'F' is no option letter of five"),
    ("e.g. E", "ABCDE", "E", True, "lower-case e skipped"),
    ("Answer: E", "ABCDE", "A", False, "the 'A' of 'Answer' comes first"),
    ("Best answer: E", "ABCDE", "B", False, "'Best answer:' is never deleted (missing comma)"),
    ("Best answer:Best option: E", "ABCDE", "E", True, "the run-together prefix is deleted"),
    ("CORRECT: E", "ABCDE", "C", False, ""),
    ("Based on the video, the answer is E.", "ABCDE", "B", False, "'B' of 'Based'"),
    ("Because he is training, E.", "ABCDE", "B", False, "'B' of 'Because'"),
    ("A man is training.", "ABCDE", "A", False, "article 'A' read as a letter"),
    ("DANCING", "ABCDE", "D", False, "capital words count"),
    ("Dancing? No: E.", "ABCDE", "D", False, ""),
    # lower case: no letter
    ("e. training.", "ABCDE", "", False, "lower case is not read"),
    ("e", "ABCDE", "", False, ""),
    ("The answer is e.", "ABCDE", "", False, ""),
    # no letter at all / the option text without its letter
    ("training.", "ABCDE", "", False, "option text alone chooses nothing"),
    ("Training.", "ABCDE", "", False, "'T' is no option letter"),
    ("He is training.", "ABCDE", "", False, "'H' is no option letter"),
    ("I don't know.", "ABCDE", "", False, ""),
    ("None of the options.", "ABCDE", "", False, ""),
    ("", "ABCDE", "", False, "empty output"),
    ("   ", "ABCDE", "", False, ""),
    ("F", "ABCDE", "", False, "no option F"),
    ("Éclair", "ABCDE", "", False, "É is not E"),
    ("\uff25", "ABCDE", "", False, "full-width E is not E"),
    # several letters: the first one
    ("A or E", "ABCDE", "A", False, ""),
    ("E or A", "ABCDE", "E", True, ""),
    ("B, C and E", "ABCDE", "B", False, ""),
    ("ABCDE", "ABCDE", "A", False, ""),
    # four options: Video-MME's own class [ABCD]
    ("D. dancing.", "ABCD", "D", True, ""),
    ("E", "ABCD", "", False, "E is no letter of a four-option question"),
    ("E. dancing, D", "ABCD", "D", True, "E skipped"),
    ("Definitely D", "ABCD", "D", True, "'D' of 'Definitely'"),
    ("Definitely C", "ABCD", "D", True, "'D' of 'Definitely': right by luck, C was meant"),
    ("Clearly D", "ABCD", "C", False, "'C' of 'Clearly'"),
]


def test_mc_table_size():
    assert len(MC_TABLE) >= 50


@pytest.mark.parametrize("output, letters, extracted, correct, why", MC_TABLE,
                         ids=[f"{i}:{row[0]!r}" for i, row in enumerate(MC_TABLE)])
def test_extract_option_letter_table(output, letters, extracted, correct, why):
    options = FIVE if letters == "ABCDE" else FOUR
    assert option_letters(options) == letters
    chosen = extract_option_letter(output, letters)
    assert chosen == extracted, why
    assert (chosen == answer_letter(ANSWER[letters], options)) is correct, why


def test_option_letters_widen_videomme_class():
    assert option_letters(FIVE) == "ABCDE"
    assert option_letters(FOUR) == "ABCD"
    assert option_letters(THREE) == "ABCD"  # Video-MME's class: D read, and wrong
    assert extract_option_letter("D", option_letters(THREE)) == "D"
    assert extract_option_letter("E. training.") == ""  # default: Video-MME's [ABCD]


@pytest.mark.parametrize("answer, letter", [
    ("E. training.", "E"), ("E", "E"), ("E ", "E"), ("(E) training", "E"), ("E) training", "E"),
    ("E: training", "E"), (" E. training.", "E"), ("B. swimming.", "B"),
    ("training.", "E"), ("Training", "E"), ("training", "E"),   # the option's text alone
    ("F. flying.", None), ("F", None),                            # no such option
    ("A man is training.", None),                                 # a sentence, not a letter
    ("e. training.", None),                                       # lower case: no letter
    ("", None), ("flying", None),
])
def test_answer_letter(answer, letter):
    assert answer_letter(answer, FIVE) == letter


def test_answer_letter_ambiguous_text():
    assert answer_letter("same", {"A": "same", "B": "Same.", "C": "other"}) is None


@pytest.mark.parametrize("pred, refs, em, relaxed", [
    ("Yes.", ["yes"], 1.0, 1.0),
    ("10.4", ["10"], 0.0, 1.0),      # 4 % off: relaxed accuracy accepts
    ("11", ["10"], 0.0, 0.0),        # 10 % off
    ("1,200", ["1200"], 0.0, 1.0),
    ("the cat", ["cat"], 0.0, 0.0),
])
def test_exact_and_relaxed(pred, refs, em, relaxed):
    assert exact_match(pred, refs) == em and relaxed_match(pred, refs) == relaxed
