"""Prompt sets for workload phases: predictable text (high acceptance) and hard text (low acceptance)."""

from __future__ import annotations

from tuner.lab.corpus import hard_prompts, predictable_prompts

PREDICTABLE: tuple[str, ...] = tuple(predictable_prompts())
HARD: tuple[str, ...] = tuple(hard_prompts())

PROMPT_SETS: dict[str, tuple[str, ...]] = {"predictable": PREDICTABLE, "hard": HARD}
