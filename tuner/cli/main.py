"""The ``spectuner`` command. Each sub-command lives in its own module with a ``register(app)``.

Start-up is lazy: a command's module (and with it sqlalchemy, scipy, vLLM...) is imported only when
that command runs. ``spectuner --help`` lists the commands from ``_HELP`` without importing any of
them. A module in ``_COMMAND_MODULES`` without a ``_HELP`` entry still works; it is imported at start
(slower ``--help``). ``tests/unit/tuner/cli/test_admin.py`` checks ``_HELP`` against the real commands.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

import typer
import typer.main
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup
from typer.exceptions import TyperException

# Order is the order `spectuner --help` lists them in. Other modules append their name here.
_COMMAND_MODULES = (
    "tuner.cli.status",
    "tuner.cli.history",
    "tuner.cli.apply",
    "tuner.cli.pause",
    "tuner.cli.drafts",
    "tuner.cli.shadow",
    "tuner.cli.estimate",
    "tuner.cli.recommend",
    "tuner.cli.collect",
    "tuner.cli.tap",
    "tuner.cli.db",
    "tuner.cli.run",
    "tuner.cli.lab",
    "tuner.cli.demo",
    "tuner.cli.report",
    "tuner.cli.simulate",
)

# module -> {command name: the first paragraph of its help}, so that --help imports nothing heavy.
# Changed a command's docstring? Change its line here too (tests/unit/tuner/cli/test_admin.py checks).
_HELP: dict[str, dict[str, str]] = {
    "tuner.cli.status": {
        "status": "Per engine series: the config in force, α̂ and throughput over the last window, "
        "pause, pending changes, the last decision and recent events."
    },
    "tuner.cli.history": {
        "history": "The audit log, newest first: decisions (with who, status and predicted/realized gain), "
        "events and config changes."
    },
    "tuner.cli.apply": {
        "apply": "Ask the controller to apply a config (a manual override, audited with who and when)."
    },
    "tuner.cli.pause": {
        "pause": "Pause the controller: it keeps measuring but changes nothing until `spectuner resume`.",
        "resume": "Lift every pause in force; the controller acts again on its next tick.",
    },
    "tuner.cli.drafts": {"drafts": "The registry of draft candidates (list, add, remove; audited)."},
    "tuner.cli.shadow": {
        "shadow": "Measure draft candidates on recorded traffic without loading them (run, forget)."
    },
    "tuner.cli.estimate": {
        "estimate": "Estimate α (per-token acceptance of the draft) from one /metrics dump (totals since the "
        "engine started) or two (what happened between them)."
    },
    "tuner.cli.recommend": {"recommend": "Recommend K (and a per-batch-size K table) from α and the cost of drafting."},
    "tuner.cli.collect": {
        "collect": "Scrape vLLM's /metrics every --interval-s seconds and store per-engine windows of deltas."
    },
    "tuner.cli.tap": {
        "tap": "Forward OpenAI API traffic to vLLM untouched and store each response's per-request "
        "speculative-decoding metrics (vLLM needs --per-request-spec-decode-metrics summary|detailed; "
        "streaming clients need stream_options.include_usage, or vLLM --enable-force-include-usage)."
    },
    "tuner.cli.db": {"db": "Database schema: create or upgrade it, show its revision, step it back."},
    "tuner.cli.run": {"run": "Run the sidecar: scrape the engine, decide, apply through the actuator, verify, audit."},
    "tuner.cli.lab": {"lab": "The lab: tiny local models and a real vLLM engine on CPU."},
    "tuner.cli.demo": {
        "demo": "The closed loop on the lab engine: weak draft → swap → K per load, every decision explained."
    },
    "tuner.cli.report": {
        "report": "Write a self-contained HTML report (α̂ over time, per-position acceptance, K/draft/decisions, "
        "goodput against K, predicted against realized gain) and report.json."
    },
    "tuner.cli.simulate": {
        "simulate": "Simulate a speculative-decoding engine (seeded, deterministic) and drive the real controller "
        "and the comparison policies through it."
    },
}


def load_commands(module_name: str) -> dict[str, Any]:
    """Import one command module and return the click commands its ``register`` adds."""
    sub = typer.Typer()
    importlib.import_module(module_name).register(sub)
    group = typer.main.get_group(sub)
    assert isinstance(group, TyperGroup)
    return dict(group.commands)


class _Placeholder(TyperCommand):
    """Stands in for a command in ``--help`` until the command is run."""

    def __init__(self, name: str, module: str, help_text: str) -> None:
        super().__init__(name, help=help_text)
        self.module = module


class LazyGroup(TyperGroup):
    """A TyperGroup whose lazy commands are placeholders until :meth:`resolve_command` picks one."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        eager = dict(self.commands)
        commands: dict[str, Any] = {}
        for module in _COMMAND_MODULES:
            if module in _HELP:
                for name, text in _HELP[module].items():
                    commands[name] = _Placeholder(name, module, text)
            else:  # not declared lazy: import now, as before
                commands.update(load_commands(module))
        commands.update(eager)  # commands registered on `app` itself, if any
        self.commands = commands

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name, cmd, rest = super().resolve_command(ctx, args)
        if isinstance(cmd, _Placeholder) and name is not None:
            loaded = load_commands(cmd.module)
            if name not in loaded:  # a _HELP entry out of step with its module (the unit test catches it)
                raise RuntimeError(f"{cmd.module} does not define the command {name!r}; fix _HELP in {__name__}")
            cmd = self.commands[name] = loaded[name]
        return name, cmd, rest

    def invoke(self, ctx: Any) -> Any:
        """Run the command; an exception it did not catch becomes one line and exit 1 or 2
        (``tuner.cli.boundary``), never a traceback. Typer's own exits and usage errors pass through."""
        try:
            return super().invoke(ctx)
        except (TyperException, typer.Exit, typer.Abort):
            raise
        except Exception as exc:
            from tuner.cli.boundary import describe_failure, log
            from tuner.cli.common import err_console

            code, message = describe_failure(exc)
            log.debug("the command failed", exc_info=exc)
            err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
            raise typer.Exit(code) from None


app = typer.Typer(
    name="spectuner",
    cls=LazyGroup,
    help="Measure, tune and explain vLLM speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at debug level."),
) -> None:
    level = logging.DEBUG if verbose else getattr(logging, os.environ.get("SPECTUNER_LOG", "WARNING"))
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:  # one INFO line per HTTP request (every scrape) drowns the daemon's own log
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(max(level, logging.WARNING))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
