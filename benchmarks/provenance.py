"""What every benchmark's results file records: the commit it ran at and the command that made it,
so that ``tools/results_age.py`` can tell a result older than the code it measures."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import torch

from hf_actq.report.provenance import checkout_commit

REPO = Path(__file__).resolve().parents[1]


def _record() -> dict:
    return {
        "commit": checkout_commit(REPO),
        "command": shlex.join(["python", *sys.argv]),
        "torch": torch.__version__,
    }


# Taken when a benchmark starts (it imports this first): the code it measures is the code it
# loaded, not whatever is checked out when a run of minutes or hours writes its results.
_STARTED = _record()


def provenance() -> dict:
    """The checkout's commit (``+``: uncommitted changes on top) when the run started, the
    command, torch's version."""
    return dict(_STARTED)


def write_json(path: str | Path, payload: dict) -> None:
    """``payload`` as JSON under ``path``, with its provenance first (replacing any the payload
    carries from an earlier run it extends)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    data = {"provenance": provenance()}
    data.update((key, value) for key, value in payload.items() if key != "provenance")
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")
