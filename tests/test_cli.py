"""Every command's one dialect (contract/cli.py), in this process: a user error is exit code 2
with the last stderr line ``<prog>: error: <message>``; a bug propagates (a traceback); an
environment failure (full disk, signal) is the same line with its own exit code. Also the one
progress style (contract/console.py)."""

from __future__ import annotations

import importlib
import io
import signal
import sys
from pathlib import Path

import click
import pytest

from contract.cli import run_click
from contract.console import Progress
from contract.errors import RunFailure, UsageError

REPO = Path(__file__).resolve().parents[1]


def _entry(module: str):
    """The ``main`` of a command: a package's ``__main__``, a module, or a top-level script."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(module).main


def _bug(*_args, **_kwargs):
    raise RuntimeError("a bug")


def user_error(capsys, main, argv: list[str], prog: str) -> str:
    """Runs ``main(argv)``: exit code 2 and ``<prog>: error: ...`` last on stderr; the message."""
    capsys.readouterr()
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: error: "), last
    return last.removeprefix(f"{prog}: error: ")


# (module of main, prog, [user-error argv -> words in the message], what a bug is planted in)
CASES = {
    "converters": ("converters.__main__", [
        (["mantis", "--source", "x"], "Missing option '--out'"),
        (["infovqa", "--source", "{tmp}", "--out", "{tmp}/o", "--workers", "0"], "--workers"),
    ], "converters.__main__.precheck",
        ["mantis", "--source", "{tmp}", "--out", "{tmp}/o"]),
    "energon_tasks": ("energon_tasks.__main__", [
        (["grid", "--image", "4x4"], "Missing option '--model'"),
        (["grid", "--model", "nope", "--image", "4x4"], "unknown model 'nope'"),
        (["grid", "--model", "qwen3-vl", "--image", "1x300"], "1x300"),
        (["inspect", "{tmp}/none"], "does not exist"),
    ], "energon_tasks.__main__.get_geometry", ["grid", "--model", "qwen3-vl", "--image", "4x4"]),
    "lookalikes": ("lookalikes.__main__", [
        (["--out", "{tmp}", "--only", "nope"], "unknown ['nope']"),
    ], "lookalikes.__main__.BUILDERS", ["--out", "{tmp}", "--only", "mantis"]),
    "lookalikes.demo": ("lookalikes.demo", [
        (["--workers", "many"], "'many' is not a valid integer"),
    ], "lookalikes.demo.run_conversions", ["--out", "{tmp}"]),
    "train.py": ("train", [
        ([], "Missing argument 'CONFIG'"),
        (["{tmp}/none.yaml"], "none.yaml"),
    ], "train.load_run_config", ["{tmp}/none.yaml"]),
    "eval.py": ("eval", [
        ([], "--ckpt CKPT is required"),
        (["--ckpt", "{tmp}/none"], "does not exist"),
    ], "eval.run", ["--ckpt", "{tmp}/none"]),
    "models.convert": ("models.convert", [
        (["verify", "--hf", "{tmp}/none", "--mcore", "{tmp}"], "'--hf'"),
        (["hf-to-mcore", "--hf", "{tmp}/none", "--out", "{tmp}/o"], "--hf"),
        (["mcore-to-hf", "--mcore", "{tmp}", "--out", "{tmp}/o"], "is not a model checkpoint"),
    ], "models.convert.hf_to_mcore", ["hf-to-mcore", "--hf", "{tmp}/none", "--out", "{tmp}/o"]),
    "recipes.report": ("recipes.report", [
        (["{tmp}/report"], "Missing argument 'RUNS...'"),
        (["{tmp}/report", "{tmp}"], "no metrics.jsonl"),
    ], "recipes.report.read_metrics", ["{tmp}/report", "{tmp}"]),
}


def _argv(argv: list[str], tmp: Path) -> list[str]:
    return [arg.replace("{tmp}", str(tmp)) for arg in argv]


@pytest.mark.parametrize("prog", list(CASES))
def test_user_error_is_one_line_exit_2_and_a_bug_a_traceback(prog, capsys, monkeypatch,
                                                              tmp_path):
    module, errors, planted, bug_argv = CASES[prog]
    main = _entry(module)
    for argv, words in errors:
        message = user_error(capsys, main, _argv(argv, tmp_path), prog)
        assert words in message, (argv, message)
    target, name = planted.rsplit(".", 1)
    if name == "BUILDERS":
        monkeypatch.setitem(importlib.import_module(target).BUILDERS, "mantis", _bug)
    else:
        monkeypatch.setattr(importlib.import_module(target), name, _bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(_argv(bug_argv, tmp_path))
    assert f"{prog}: error" not in capsys.readouterr().err


def test_a_group_without_command_shows_help_then_the_line(capsys):
    main = _entry("energon_tasks.__main__")
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Usage: python -m energon_tasks" in err[0]
    assert err[-1] == "energon_tasks: error: missing command"


def test_help_exits_0(capsys):
    assert _entry("converters.__main__")(["mantis", "--help"]) == 0
    assert "Usage: python -m converters mantis" in capsys.readouterr().out


@pytest.mark.parametrize("failure, code, words", [
    ("OutOfSpace", 1, "No space left on device"),
    ("Interrupted", 128 + signal.SIGTERM, "interrupted (SIGTERM); run the same command again"),
    ("KeyboardInterrupt", 130, "interrupted; run the same command again to resume"),
    ("OSError", 1, "Permission denied"),
])
def test_converter_failures_keep_their_exit_codes_in_the_dialect(failure, code, words, capsys,
                                                                  monkeypatch, tmp_path):
    from converters import pipeline

    errors = {"OutOfSpace": pipeline.OutOfSpace("No space left on device (x)"),
              "Interrupted": pipeline.Interrupted(signal.SIGTERM),
              "KeyboardInterrupt": KeyboardInterrupt(),
              "OSError": PermissionError(13, "Permission denied", "y")}

    def fail(_opts):
        raise errors[failure]

    main = _entry("converters.__main__")
    monkeypatch.setattr("converters.__main__.precheck", fail)
    assert main(["mantis", "--source", str(tmp_path), "--out", str(tmp_path / "o")]) == code
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("converters: error: ") and words in last, last


def test_the_runner_itself(capsys):
    @click.command()
    @click.argument("what")
    def cli(what):
        if what == "usage":
            raise UsageError("bad\n   input  here")
        if what == "failure":
            raise RunFailure("disk full", 7)
        if what == "ctrl-c":
            raise KeyboardInterrupt
        return 3

    assert run_click(cli, "tool", ["usage"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "tool: error: bad input here"
    assert run_click(cli, "tool", ["failure"]) == 7
    assert capsys.readouterr().err.splitlines()[-1] == "tool: error: disk full"
    assert run_click(cli, "tool", ["ctrl-c"]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "tool: aborted"
    assert run_click(cli, "tool", ["ok"]) == 3


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_lines_in_a_log_and_a_bar_on_a_terminal():
    log = io.StringIO()
    progress = Progress("mantis p0", 0, total=4, unit="rows", stream=log)
    progress.advance(1)
    progress.advance(3)
    progress.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 3 and all(line.startswith("[mantis p0] ") for line in lines), lines
    assert lines[0].startswith("[mantis p0] 1/4 rows, 25%, ") and "ETA" in lines[0], lines
    assert "rows/s" in lines[0] and " elapsed" in lines[0]
    assert lines[-1].startswith("[mantis p0] 4/4 rows, 100%, ") and "ETA" not in lines[-1]
    uncounted = io.StringIO()  # eval.py's use: the total comes with each update, no last line
    progress = Progress("eval", 0, stream=uncounted)
    progress.update(2, 5, "conversations", " (3 questions answered)")
    progress.close()
    assert uncounted.getvalue().startswith(
        "[eval] 2/5 conversations (3 questions answered), 40%, ")
    assert len(uncounted.getvalue().splitlines()) == 1
    terminal = _Terminal()
    with Progress("mantis p0", 0, total=4, unit="rows", stream=terminal) as progress:
        progress.advance(4)
    assert "[mantis p0]" not in terminal.getvalue() and "4/4" in terminal.getvalue()
