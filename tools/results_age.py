"""List the committed results that are older than the code they measure.

    python tools/results_age.py [--code hf_actq] [--min-commits 1] [--json out.json]

For each results file (``benchmarks/results/**``, ``recipes/*/results/**``; JSON and Markdown)
the commit it was made at is its own record's (``provenance.commit`` or ``commit``, as the
benchmarks and recipes write it); else, for a file committed together with a JSON record beside it
(``hf-actq memory --output`` writes memory.md and plan files next to memory.json), that record's
commit; else, for a memory.md whose table shows the figures of the memory.json beside it, that
record's commit; else the commit that last changed the file. A result is older
than the code when the package (``--code``) has changed what it does since that commit; the list
gives how many commits and files changed it, oldest first, and says which files name no commit.
A change to a Python file's docstrings, comments or layout alone changes nothing a result
measured: the file's syntax tree without its docstrings is the same, so that commit is not
counted (``--any-change`` counts it).

A recipe result that ``tools/replay_results.py`` replayed with the verdict ``same`` (or ``same
code``, ``prefix same``) against a later commit is aged from that commit: its first steps, bytes
and peak were the same there. The replay record (``replays.json`` beside the results) is not itself a result.
Each row shows the replay's verdict; results the replay found ``retired`` (a recipe the sweep
no longer defines) are listed apart: nothing can re-run them, and they are no claim about HEAD.
So are records of earlier code kept on purpose (a "before" table beside an "after"): a JSON
result whose top-level ``record`` says what it records and why, with the files beside it.

A table a recipe renders from the results below it (``RENDERED``) is aged from the oldest of
those results, leaving out the retired ones and the records.
A development check: nothing in hf_actq imports it.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _provenance():
    """hf_actq/report/provenance.py, loaded by path: importing the package would cost torch."""
    spec = importlib.util.spec_from_file_location(
        "_provenance", REPO / "hf_actq" / "report" / "provenance.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RESULTS = _provenance().RESULTS  # where results live, the pathspecs provenance leaves out
REPLAYS = "replays.json"  # tools/replay_results.py's record
# Tables a recipe renders from the results in the folder below them (`sweep.py --render-only`,
# `convergence.py --render-only`; tests/recipes check that each committed table is that render):
# a table is as old as the oldest result it shows that speaks for HEAD.
RENDERED = ("recipes/glue/results/table.md", "recipes/llama_lora/results/convergence/table.md")
SAME = ("same", "same code", "prefix same")  # its verdicts under which a result stands


def _git(*args: str, repo: Path = REPO) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()


def _json_object(path: Path) -> dict | None:
    """``path``'s JSON object, or None (unreadable, not JSON, not an object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def recorded_commit(path: Path) -> str | None:
    """The commit a JSON results file names (the leading hash of ``provenance.commit`` or
    ``commit``; a ``+`` after it marks uncommitted changes on top), or None."""
    data = _json_object(path) if path.suffix == ".json" else None
    if data is None:
        return None
    named = (data.get("provenance") or {}).get("commit") or data.get("commit")
    match = re.match(r"[0-9a-f]{7,40}", named or "")
    return match.group(0) if match else None


def results_files(repo: Path = REPO) -> list[Path]:
    tracked = _git("ls-files", "--", *RESULTS, repo=repo).splitlines()
    return [
        repo / name
        for name in tracked
        if name.endswith((".json", ".md")) and Path(name).name != REPLAYS
    ]


def replay_row(path: Path, repo: Path = REPO) -> dict:
    """``tools/replay_results.py``'s row for ``path``'s present contents, from its record
    (``replays.json`` in the nearest directory above that has one), or {}."""
    for folder in path.parents:
        record_path = folder / REPLAYS
        if record_path.exists():
            row = json.loads(record_path.read_text()).get(str(path.relative_to(repo)), {})
            content = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
            return row if row.get("content") == content else {}
        if folder == repo:
            break
    return {}


def kept_record(path: Path) -> str:
    """Why ``path`` is kept as a record of earlier code: the ``record`` of its JSON, or of a
    JSON beside it (one command wrote the folder), or "" for a result that speaks for HEAD."""
    for candidate in [path] if path.suffix == ".json" else sorted(path.parent.glob("*.json")):
        record = (_json_object(candidate) or {}).get("record")
        if isinstance(record, str):
            return record
    return ""


def _last_change(path: Path, repo: Path) -> str:
    return _git("log", "-1", "--format=%h", "--", str(path.relative_to(repo)), repo=repo)


def sibling_commit(path: Path, repo: Path = REPO) -> str | None:
    """The commit a JSON record in ``path``'s folder names, when that record and ``path`` were
    last changed by the same commit: one command wrote both. A file a later run left unchanged
    (git records no change) keeps its own, older, date: the check errs towards "behind"."""
    own = _last_change(path, repo)
    for sibling in sorted(path.parent.glob("*.json")):
        named = recorded_commit(sibling) if sibling != path else None
        if named and _last_change(sibling, repo) == own:
            return named
    return None


def _report_bytes(nbytes: float) -> str:
    """A byte count as ``hf_actq/report/results.py``'s ``format_bytes`` writes it."""
    return f"{nbytes / 2**30:.2f} GiB" if abs(nbytes) >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def report_commit(path: Path) -> str | None:
    """The commit of the ``memory.json`` beside a ``memory.md`` whose table shows that record's
    figures, row by row. ``hf-actq memory`` writes both from one result, so a rerun whose table
    came out byte for byte the same (git records no change) still made it; a table that shows
    other figures than the record keeps its own date."""
    if path.name != "memory.md" or not (commit := recorded_commit(path.with_name("memory.json"))):
        return None
    rows = _json_object(path.with_name("memory.json")).get("rows")
    if not rows:
        return None
    lines = path.read_text().splitlines()
    for row in rows:
        start = f"| {row['recipe']} | {_report_bytes(row['activation_bytes'])} |"
        peak = f"| {_report_bytes(row['peak_bytes'])}"
        if not any(line.startswith(start) and peak in line for line in lines):
            return None
    return commit


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return tree


def meaning(name: str, text: str | None) -> str | None:
    """What the file ``name`` with contents ``text`` does: for Python, its syntax tree without
    docstrings (comments and layout are not in a syntax tree); else the text itself. None for
    a file that is absent."""
    if text is None or not name.endswith(".py"):
        return text
    try:
        return ast.dump(_without_docstrings(ast.parse(text)))
    except SyntaxError:
        return text


@cache
def _blobs(commit: str, code: str, repo: Path) -> dict[str, str]:
    """``code``'s files at ``commit``: path -> blob hash ({} before the first commit)."""
    try:
        listing = _git("ls-tree", "-r", commit, "--", code, repo=repo)
    except subprocess.CalledProcessError:  # the parent of the first commit
        return {}
    return {line.split("\t", 1)[1]: line.split()[2] for line in listing.splitlines()}


@cache
def _blob_meaning(blob: str | None, name: str, repo: Path) -> str | None:
    return meaning(name, None if blob is None else _git("cat-file", "-p", blob, repo=repo))


def _differ(before: str, after: str, code: str, repo: Path, any_change: bool) -> list[str]:
    """The files of ``code`` that differ between two commits (in what they do, unless
    ``any_change``)."""
    old, new = _blobs(before, code, repo), _blobs(after, code, repo)
    return [
        name
        for name in sorted(old.keys() | new.keys())
        if old.get(name) != new.get(name)
        and (
            any_change
            or _blob_meaning(old.get(name), name, repo) != _blob_meaning(new.get(name), name, repo)
        )
    ]


def code_changes(since: str, code: str, repo: Path = REPO, any_change: bool = False):
    """The commits after ``since`` that changed what ``code`` does, and the files of ``code``
    that do something else at HEAD than at ``since``. With ``any_change``, every commit and
    file that git says changed. Raises CalledProcessError for a commit this clone lacks."""
    commits = _git("rev-list", f"{since}..HEAD", "--", code, repo=repo).split()
    head = _git("rev-parse", "HEAD", repo=repo)  # a hash: the caches outlive a HEAD
    since = _git("rev-parse", "--verify", f"{since}^{{commit}}", repo=repo)
    if not any_change:
        commits = [c for c in commits if _differ(f"{c}^", c, code, repo, any_change=False)]
    return commits, _differ(since, head, code, repo, any_change)


def age(path: Path, code: str, repo: Path = REPO, any_change: bool = False) -> dict:
    """When ``path`` was made and how much of ``code`` changed since."""
    name = str(path.relative_to(repo))
    if name in RENDERED:
        shown = [r for r in results_files(repo) if path.parent in r.parents and r != path]
        ages = [age(r, code, repo, any_change) for r in shown]
        ages = [a for a in ages if a["replay"] != "retired" and not a["record"]]
        if ages:
            # Unknown (-1, a commit this clone lacks) ranks oldest.
            oldest = max(ages, key=lambda a: (a["code_commits_since"] < 0, a["code_commits_since"]))
            return oldest | {
                "file": name,
                "commit_from": f"oldest of the {len(ages)} results it renders",
                "replay": "",
                "record": "",
            }
    commit = recorded_commit(path)
    source = "recorded"
    replay = replay_row(path, repo)
    if replay.get("verdict") in SAME:
        commit, source = replay["head"], "replayed the same"
    elif commit is None and (commit := sibling_commit(path, repo)):
        source = "recorded beside it"
    elif commit is None and (commit := report_commit(path)):
        source = "shows the record beside it"
    elif commit is None:
        commit, source = _last_change(path, repo), "last change of the file"
    try:
        commits, changed = code_changes(commit, code, repo, any_change)
        count = len(commits)
    except subprocess.CalledProcessError:  # a commit this clone does not have
        count, changed = -1, []
    return {
        "file": name,
        "commit": commit,
        "commit_from": source,
        "code_commits_since": count,
        "code_files_changed": len(changed),
        "replay": replay.get("verdict", ""),
        "record": kept_record(path),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", default="hf_actq", help="the code the results measure")
    parser.add_argument("--min-commits", type=int, default=1, help="list results this far behind")
    parser.add_argument("--json", help="write every row here as well")
    parser.add_argument(
        "--any-change",
        action="store_true",
        help="count commits that change only docstrings, comments or layout as well",
    )
    args = parser.parse_args(argv)
    rows = [age(path, args.code, any_change=args.any_change) for path in results_files()]
    rows.sort(key=lambda r: (-r["code_commits_since"], r["file"]))
    retired = [r for r in rows if r["replay"] == "retired"]
    records = [r for r in rows if r["record"] and r["replay"] != "retired"]
    rows_now = [r for r in rows if r["replay"] != "retired" and not r["record"]]
    behind = [r for r in rows_now if r["code_commits_since"] >= args.min_commits]
    unknown = [r for r in rows_now if r["code_commits_since"] < 0]
    print(f"{len(behind)} of {len(rows_now)} results files are older than {args.code}/:\n")
    print(f"| file | made at | from | {args.code} commits since | files changed | replay |")
    print("|---|---|---|---:|---:|---|")
    for r in behind:
        print(
            f"| {r['file']} | {r['commit']} | {r['commit_from']} | {r['code_commits_since']} "
            f"| {r['code_files_changed']} | {r['replay']} |"
        )
    for r in unknown:
        print(f"{r['file']}: commit {r['commit']} is not in this clone")
    if retired:
        print(
            f"\n{len(retired)} results of recipes the sweeps retired (a record; none can re-run):"
        )
        print("\n".join(f"- {r['file']} ({r['commit']})" for r in retired))
    if records:
        print(f"\n{len(records)} records of earlier code, kept on purpose (in their own words):")
        print("\n".join(f"- {r['file']} ({r['commit']}): {r['record']}" for r in records))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
