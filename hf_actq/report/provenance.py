"""What a result records about the code that made it: the command, the versions and the source
commit, so that ``tools/results_age.py`` can tell a result older than the code it measures. The
one home of this for the CLI's reports, the benchmarks and the recipes."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2]


# Where results live, as git pathspecs. Results files are not code: a benchmark that writes one
# must not mark the next run's commit as carrying uncommitted changes. Nor is Markdown: the
# sweeps rewrite their README's results section after each run. tools/results_age.py
# loads this file by path to list the same files: no torch here, so it needs no package import.
RESULTS = ("benchmarks/results", ":(glob)recipes/*/results/**")


def _excluding(pathspec: str) -> str:
    """The pathspec that leaves ``pathspec``'s files out: ``:(glob)a/**`` -> ``:(exclude,glob)a/**``."""
    magic, path = pathspec[2:].split(")", 1) if pathspec.startswith(":(") else ("", pathspec)
    return f":({','.join(['exclude', *filter(None, [magic])])}){path}"


CODE_PATHSPECS = (".", *map(_excluding, RESULTS), ":(exclude,glob)**/*.md")


def checkout_commit(repo: Path, *paths: str) -> str | None:
    """The short commit of the git checkout at ``repo``, with ``+`` when it has uncommitted
    changes (under ``paths``, else anywhere but the results directories and Markdown); None without git or
    a checkout. A copy of the tree without its ``.git`` (what a lent GPU gets) names its commit
    in ``HF_ACTQ_COMMIT``, set by whoever sends the copy; it wins where set, since a lent GPU's
    copy came with a ``.git`` of its own making (its commit named nothing here)."""
    if os.environ.get("HF_ACTQ_COMMIT"):
        return os.environ["HF_ACTQ_COMMIT"]
    if not (Path(repo) / ".git").exists():
        return None
    paths = paths or CODE_PATHSPECS
    try:
        head, dirty = (
            subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True).stdout.strip()
            for args in (
                ("rev-parse", "--short", "HEAD"),
                ("status", "--porcelain", "--untracked-files=no", "--", *paths),
            )
        )
    except OSError:
        return None
    return (head + ("+" if dirty else "")) or None


def provenance(argv=None) -> dict:
    """``hf-actq memory``'s record: the command, hf_actq's and torch's versions and, when hf_actq
    runs from a git checkout of its source, the commit (``+``: uncommitted changes in the
    package)."""
    try:
        hf_actq_version = version("hf_actq")
    except PackageNotFoundError:  # run from a source tree that is not installed
        hf_actq_version = None
    # An installed copy's parent directory may lie inside some other checkout: ours has .git
    # (checkout_commit looks for it).
    commit = checkout_commit(SOURCE, "hf_actq")
    words = sys.argv[1:] if argv is None else list(argv)
    import torch  # here, not at the top: tools/results_age.py loads this file without torch

    return {
        "command": shlex.join(["hf-actq", "memory", *words]),
        "commit": commit,
        "hf_actq": hf_actq_version,
        "torch": torch.__version__,
    }
