"""The `llmopt` command: command groups, --version, and the one error boundary."""

from __future__ import annotations

import errno
import os
import signal
import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

try:  # Typer vendors Click from 0.2x on: its exceptions, not the click package's
    from typer._click import exceptions as click
except ImportError:  # older Typer runs on the click package
    from click import exceptions as click

from llmopt import __version__
from llmopt.core.errors import LLMOptError


# Exit codes (README, "Errors, exit codes and outputs"): 0 success, 1 an error the user can fix, 2 a usage
# error (the Unix convention: unknown option, bad option value), 130 interrupted (Ctrl-C), 143 terminated
# (SIGTERM: 128 + 15, as a shell reports it).
EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 130, 143
# OS errors that bad input or a full / read-only disk cause: one line, not a traceback
FULL_DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT)
USER_OS_ERRORS = (*FULL_DISK_ERRORS, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR,
                  errno.ELOOP, errno.ENAMETOOLONG)
# pathlib's resolve() reports a symlink loop as a RuntimeError (Python < 3.13), not an OSError
SYMLINK_LOOP = "Symlink loop from "


def _say(message: str, error: bool = True) -> None:
    """One line on stderr; an error's prefix in red on a terminal (the message itself is never read as markup)."""
    from rich.markup import escape

    from llmopt.cli.output import stderr

    stderr.print(("[red]error:[/red] " if error else "") + escape(message), highlight=False, soft_wrap=True)


def _os_error_message(e: OSError) -> str:
    where = f" ({e.filename})" if e.filename else ""
    advice = ("free space or choose another location" if e.errno in FULL_DISK_ERRORS
              else "a symbolic link points back at itself: fix or remove it" if e.errno == errno.ELOOP
              else "check the path and its permissions")
    return f"{e.strerror}{where}: {advice}; nothing was written"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that it unwinds as Ctrl-C does (temporaries removed)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _interrupted_message(how: str = "interrupted") -> str:
    from llmopt.core.io import PENDING_OUTPUTS

    if PENDING_OUTPUTS:
        return f"{how}; nothing was written to {', '.join(map(str, PENDING_OUTPUTS))}"
    return how


class ErrorBoundaryGroup(TyperGroup):
    """The one error boundary: LLMOptError and OS errors a user can fix become one line on stderr and exit 1,
    usage errors one line and exit 2, Ctrl-C one line and exit 130 (tracebacks with LLMOPT_DEBUG=1)."""

    def invoke(self, ctx: typer.Context):
        from llmopt.core.io import PENDING_OUTPUTS

        PENDING_OUTPUTS.clear()  # this command's outputs only (tests run many commands in one process)
        try:
            return super().invoke(ctx)
        except LLMOptError as e:
            if os.environ.get("LLMOPT_DEBUG"):
                raise
            _say(str(e))
            sys.exit(EXIT_ERROR)
        except OSError as e:
            if os.environ.get("LLMOPT_DEBUG") or e.errno not in USER_OS_ERRORS:
                raise
            _say(_os_error_message(e))
            sys.exit(EXIT_ERROR)
        except RuntimeError as e:
            if os.environ.get("LLMOPT_DEBUG") or not str(e).startswith(SYMLINK_LOOP):
                raise
            _say(f"{str(e).removeprefix(SYMLINK_LOOP)} is a symbolic link loop: fix or remove the link; nothing "
                 f"was written")
            sys.exit(EXIT_ERROR)
        except KeyboardInterrupt as e:
            terminated = isinstance(e, Terminated)
            _say(_interrupted_message("terminated" if terminated else "interrupted"), error=False)
            sys.exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Click's own handling, except that a usage error is one line (which command, what is wrong, where
        the help is) instead of a boxed block."""
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = code if isinstance(code, int) else 0
        except click.NoArgsIsHelpError as e:
            typer.echo(e.ctx.get_help())
            code = EXIT_USAGE
        except click.UsageError as e:
            command = e.ctx.command_path if e.ctx else "llmopt"
            _say(f"{e.format_message().replace('Value error, ', '')} (usage: see `{command} --help`)")
            code = EXIT_USAGE
        except click.ClickException as e:
            _say(e.format_message())
            code = e.exit_code
        except typer.Abort:
            _say(_interrupted_message(), error=False)
            code = EXIT_INTERRUPTED
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    name="llmopt", cls=ErrorBoundaryGroup, no_args_is_help=True, pretty_exceptions_enable=False,
    add_completion=False, help="Make Hugging Face causal LMs smaller and faster, and prove it.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmopt {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Make Hugging Face causal LMs smaller and faster, and prove it."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _register() -> None:
    from llmopt.cli import env, eval as eval_cli, generate, models

    app.add_typer(models.app, name="models")
    app.add_typer(eval_cli.app, name="eval")
    app.command("generate")(generate.generate)
    app.command("env")(env.env)
    from llmopt.cli import bench, distill, export, plan, prune, quantize, recipe, report, serve

    app.command("quantize")(quantize.quantize)
    app.command("prune")(prune.prune)
    app.command("distill")(distill.distill)
    app.command("export")(export.export)
    app.command("bench")(bench.bench)
    app.command("serve")(serve.serve)
    app.add_typer(recipe.app, name="recipe")
    app.command("report")(report.report)
    app.command("plan")(plan.plan)


_register()


def main() -> None:
    """The console entry point. SIGTERM (a scheduler's or container's stop) unwinds like Ctrl-C; commands that
    stop gracefully on it (serve, distill) install their own handler while they run."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        app()
        code = 0
    except SystemExit as e:
        code = e.code
    _exit(code)


def _exit(code) -> None:
    """End the process as the interpreter would (its other threads joined, the atexit handlers run: engine
    processes stopped, shared memory unlinked, logs flushed), then without the interpreter's finalization, where
    extensions built with nanobind (Triton's, imported by torch) print dozens of "nanobind: leaked" lines about
    objects that are only alive because the process is ending."""
    import atexit
    import threading

    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = EXIT_ERROR
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (a closed pipe: nothing more can be said)
            pass
    os._exit(code or 0)
