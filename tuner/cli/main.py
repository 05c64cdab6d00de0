"""The ``spectuner`` command. Each sub-command lives in its own module with a ``register(app)``."""

from __future__ import annotations

import importlib
import logging
import os

import typer

app = typer.Typer(
    name="spectuner",
    help="Measure, tune and explain vLLM speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Order is the order `spectuner --help` lists them in.
_COMMAND_MODULES = (
    "tuner.cli.estimate",
    "tuner.cli.recommend",
    "tuner.cli.collect",
    "tuner.cli.tap",
    "tuner.cli.db",
    "tuner.cli.run",
    "tuner.cli.lab",
    "tuner.cli.demo",
)

for _name in _COMMAND_MODULES:
    importlib.import_module(_name).register(app)


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at debug level."),
) -> None:
    level = logging.DEBUG if verbose else getattr(logging, os.environ.get("SPECTUNER_LOG", "WARNING"))
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
