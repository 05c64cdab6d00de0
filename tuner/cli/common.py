"""Shared CLI plumbing: exit codes from DESIGN.md, JSON output, clear errors."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2

err_console = Console(stderr=True)
out_console = Console()


def fail_usage(message: str) -> NoReturn:
    """A usage or configuration error: say what is wrong and how to fix it, exit 2."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_USAGE)


def fail_runtime(message: str) -> NoReturn:
    """A runtime failure (engine down, database unreachable...): exit 1."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_RUNTIME)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()
