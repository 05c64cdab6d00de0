"""`spectuner run` (placeholder until the controller lands; its owner replaces this file)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    return None
