"""Run inputs that are refused, or read as given, before any model is built (issue 45): the
command line's text for string keys, value ranges, bounded YAML, blend weights, budgets against
the model, the make targets an error names. Each runs in this process (config loading, or
train.py's / eval.py's ``main`` up to its one-line error)."""

from __future__ import annotations

import pytest

from recipes.run_config import ConfigError, load_run_config
from tests.test_train import MANTIS_CFG


# ------------------------------------------------------------------ the command line's text
@pytest.mark.parametrize("typed, kept", [("0010", "0010"), ("no", "no"), ("exp #2", "exp #2"),
                                         ("1e3", "1e3"), ("[a]", "[a]")])
def test_string_keys_keep_the_text_given(typed, kept):
    """``out=0010`` is the folder ``0010`` (not 8), ``out=no`` not ``False``, ``out='exp #2'``
    not ``exp``: every string key keeps the command line's text; other keys read YAML."""
    cfg = load_run_config(MANTIS_CFG, [f"out={typed}", f"data.path={typed}",
                                       f"checkpoint.dir={typed}", f"data.split_part={typed}",
                                       "train.steps=0012", "log.tensorboard=no"])
    assert (cfg.out, cfg.data.path, cfg.checkpoint.dir, cfg.data.split_part) == (kept,) * 4
    assert cfg.train.steps == 12 and cfg.log.tensorboard is False


def test_null_is_none_where_a_string_key_allows_it():
    cfg = load_run_config(MANTIS_CFG, ["checkpoint.dir=null", "task_encoder.tokenizer=~",
                                       "out=null"])
    assert cfg.checkpoint.dir is None and cfg.task_encoder.tokenizer is None
    assert cfg.out == "null"  # out takes no null: the text


def test_a_choice_key_names_its_values():
    """``model.recompute=yes``: the allowed values, not "expected str, got True"; the same
    in a YAML file (where yes is a boolean) says to quote it."""
    with pytest.raises(ConfigError) as typed:
        load_run_config(MANTIS_CFG, ["model.recompute=yes"])
    assert "none" in str(typed.value) and "selective" in str(typed.value), typed.value
    assert "'yes'" in str(typed.value)


def test_quotes_left_by_a_shell_spell_the_string():
    cfg = load_run_config(MANTIS_CFG, ["out='exp #2'", 'data.path="0010"', "data.split_part='a"])
    assert (cfg.out, cfg.data.path, cfg.data.split_part) == ("exp #2", "0010", "'a")
