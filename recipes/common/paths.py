"""Local paths on a recipe's command line, checked before anything loads: a missing one stops
the run with one line naming its flag, not a traceback from deep inside datasets or
transformers."""

from __future__ import annotations

import sys
from pathlib import Path


def looks_local(value: str) -> bool:
    """Whether a model or dataset argument names a local path rather than a hub id ("org/name"
    or "name"): it starts like a path, has more than one "/", or names a JSON file."""
    return (
        value.startswith(("/", "./", "../", "~", "."))
        or value.count("/") > 1
        or value.endswith((".json", ".jsonl", ".csv", ".tsv"))
    )


def require_paths(script: str, **flags: tuple[str | None, str]) -> None:
    """``flag=(value, what it should be)``: exit in one line for the first ``value`` given that
    does not exist, naming the flag and what was expected."""
    for flag, (value, expected) in flags.items():
        if value is not None and not Path(value).expanduser().exists():
            sys.exit(f"{Path(script).name}: --{flag} {value!r} does not exist ({expected})")
