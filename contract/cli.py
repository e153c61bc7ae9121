"""How every command-line entry of the project runs its click command, in one dialect.

``python -m converters``, ``python -m energon_tasks``, ``python -m lookalikes`` (and
``lookalikes.demo``), train.py, eval.py, ``python -m models.convert`` and
``python -m recipes.report``: each ``main(argv)`` is ``run_click(cli, prog, argv)``. Then

- a click usage error or one of the project's user errors (``contract.errors``: ``UsageError``,
  ``ConfigError``, ``MediaError``, and the command's own ``user_errors``) is the last stderr line
  ``<prog>: error: <message>`` (one line, whitespace collapsed), exit code 2;
- a ``RunFailure`` (a full disk, a dead worker, a signal: the run's environment) is the same line
  with the failure's exit code (1, 130, 143, ...);
- CTRL-C (``KeyboardInterrupt``, click's ``Abort``) is ``<prog>: aborted``, exit code 130;
- a group run without a command prints its help, then ``<prog>: error: missing command``, 2;
- anything else is a bug and propagates: a traceback, never one line.

``prog`` is the command's short name (``converters``, ``train.py``, ``models.convert``); help and
usage text show how to run it (``python -m converters`` for a module).

Under torchrun every rank meets the same user error or run failure (train.py checks its inputs
before any process group, the same way on every rank; a failed save or a non-finite stop is
agreed by a collective): rank 0 prints the line at once, the other ranks wait ``PEER_GRACE_S``
first, with SIGTERM back at its default, so the launcher ending them then ends them silently and
the line is printed once; an error only a later rank meets is still printed, after the wait.
``recipes.launch`` (the project's torchrun) then exits with the rank's code without a traceback
of its own. Such a rank ends right after its line (``os._exit`` with its code: no interpreter
teardown, which can abort with a process group whose peer is gone).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import click

from contract.errors import ConfigError, MediaError, RunFailure, UsageError

#: the project's user errors: every command prints them as one line, exit code 2
USER_ERRORS = (UsageError, ConfigError, MediaError)
#: seconds a torchrun rank other than 0 waits before it prints a user error (see above)
PEER_GRACE_S = 10.0


def error_line(prog: str, message: str) -> str:
    """``<prog>: error: <message>`` on one line (the message's whitespace collapsed)."""
    return f"{prog}: error: {' '.join(str(message).split())}"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_click(command: click.Command, prog: str, argv: list[str] | None = None,
              user_errors: tuple[type[Exception], ...] = ()) -> int:
    """Run ``command`` on ``argv`` (default: the process arguments) as ``prog``.

    Args:
        user_errors: the command's own user-error types besides ``USER_ERRORS`` (e.g. the
            converters' ``LockedError``, ``models.hf.source.HFSourceError``).

    Returns:
        The exit code: the command's return value when it is an int (else 0); 2 for a usage or
        user error, a ``RunFailure``'s own code, 130 when aborted (see the module docstring).
    """
    no_args_is_help = getattr(click.exceptions, "NoArgsIsHelpError", ())
    invocation = prog if prog.endswith(".py") else f"python -m {prog}"
    try:
        result = command.main(args=argv, prog_name=invocation, standalone_mode=False)
    except click.exceptions.Exit as done:  # --help
        return done.exit_code
    except no_args_is_help as error:  # a group without a command: its help, then the line
        click.echo(error.ctx.get_help(), err=True)
        _say(error_line(prog, "missing command"))
        return 2
    except (click.Abort, KeyboardInterrupt):
        _say(f"{prog}: aborted")
        return 130
    except RunFailure as failure:
        _peer_wait()
        _say(error_line(prog, str(failure)))
        return _rank_code(failure.exit_code)
    except click.ClickException as error:
        message = error.format_message()
    except (*USER_ERRORS, *user_errors) as error:
        message = str(error)
    else:
        return result if isinstance(result, int) else 0
    _peer_wait()
    _say(error_line(prog, message))
    return _rank_code(2)


def _rank_code(code: int) -> int:
    """``code``; in a torchrun worker (``TORCHELASTIC_RUN_ID``) of more than one rank the process
    ends here with it (``os._exit``, after the line is out): the interpreter's teardown with a
    live process group whose peer is gone could abort in its C++ threads ("terminate called
    ...", SIGABRT), and the launcher would then report a signal instead of the rank's code.
    Every ``finally`` of the command has run by now."""
    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _peer_wait() -> None:
    """Under torchrun, a rank other than 0 waits before it says its error; the launcher's
    SIGTERM (rank 0 failed first) ends it silently meanwhile (module docstring)."""
    if os.environ.get("RANK", "0") != "0":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(PEER_GRACE_S)
