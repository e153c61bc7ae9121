"""How the recipe's command-line entries (train.py, eval.py, ``python -m models.convert``) run
their click commands: a usage error or a user error is one line on stderr, exit code 2."""

from __future__ import annotations

import sys

import click


def run_click(command: click.Command, prog: str, argv: list[str] | None,
              user_errors: tuple[type[Exception], ...] = ()) -> int:
    """Run ``command`` on ``argv`` (default: the process arguments).

    Returns:
        The exit code: the command's return value (0 when None), 2 for a usage error or one of
        ``user_errors`` (printed as ``<prog>: error: <message>``, one line).
    """
    no_args_is_help = getattr(click.exceptions, "NoArgsIsHelpError", ())
    try:
        result = command.main(args=argv, prog_name=prog, standalone_mode=False)
    except click.exceptions.Exit as done:  # --help
        return done.exit_code
    except no_args_is_help as error:  # a group without a command: its help
        click.echo(error.ctx.get_help(), err=True)
        return 2
    except click.Abort:
        print(f"{prog}: aborted", file=sys.stderr, flush=True)
        return 130
    except click.ClickException as error:
        message = error.format_message()
    except user_errors as error:
        message = str(error)
    else:
        return result if isinstance(result, int) else 0
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return 2
