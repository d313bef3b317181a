"""Check whether a recipe result still describes the code: replay its first steps at the commit it
names and at HEAD, and compare.

    python tools/replay_results.py recipes/glue/results [--steps 2] [--jobs 2]

A recipe result (a JSON file with ``command`` and ``commit``, as ``recipes/*/run.py`` write them)
takes minutes to hours to re-run. Most commits since it was made do not touch what it measured.
This tool tells the two apart. For each result it reruns the recorded command twice for
``--steps`` optimizer steps, logging the loss at every step: once in a worktree of the commit
the result names, once in a worktree of HEAD. Same machine, same thread count, fresh processes.
A result a sweep made (``sweep_recipe``) is replayed at HEAD as the sweep would run it now: the
sweep's present arguments for that recipe (``RECIPES`` in the ``sweep.py`` or
``convergence.py`` beside the script) go after the recorded ones, so a recipe pinned since to
what it used to mean (``checkpoint-4`` to the uniform codec when rotation became the default) is
compared as the table labels it.
The verdict:

- ``same``: the per-step losses are bit-identical, and so are the activation bytes and the
  step peak. HEAD runs this recipe as the named commit did, so the result stands for HEAD.
- ``same code``: the package and the recipe's directories are the same trees at both commits.
  Nothing was run.
- ``memory changed``: the same losses, other activation bytes or peak. Accuracy stands; the
  memory figures are stale.
- ``changed``: the losses differ. The result is stale: re-run it or remove it.
- ``retired``: the sweep no longer defines the result's recipe. Nothing can re-run it.
- ``commit missing`` / ``no commit``: the named commit is not in this clone, or none is named.
  With ``--prefix``, such a result is checked against its own record instead: HEAD trains up to
  the first logged loss with the full run's schedule (``--stop_after_steps``), and the verdict
  is ``prefix same`` (that loss, the bytes and the peak equal to the bit), ``prefix memory
  changed`` or ``prefix changed``. Slower: tens of steps, not two. Run it on the thread count
  the results were made with (``--threads``; GLUE's sweep runs each run on one). A later run
  without ``--prefix`` leaves such a result's recorded verdict as it is.
- ``failed``: a replay did not finish (its log's tail is recorded).

A few steps cannot see a change that acts later in training (a recalibration at 10% of the
steps, the learning-rate schedule's end). The verdict speaks for the steps replayed.

Verdicts go to ``--record`` (default ``<first directory>/replays.json``), keyed by file and by
the result's contents, so a second run skips what is already replayed against the same HEAD
code. ``tools/results_age.py`` reads it: a result replayed ``same``, ``same code`` or ``prefix
same`` against a commit is aged from that commit. A development check: nothing in hf_actq imports it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD_NAME = "replays.json"


def _git(*args: str, repo: Path = REPO) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()


def code_paths(script: str) -> tuple[str, ...]:
    """What a recipe run executes from the repository: the package, the recipe's own directory
    and the recipes' shared module."""
    return ("hf_actq", str(Path(script).parent), "recipes/common")


def code_digest(commit: str, paths: tuple[str, ...], repo: Path = REPO) -> str:
    """A digest of every file under ``paths`` at ``commit``, less the results folders: a new
    result committed beside the recipe changes no code."""
    listing = _git("ls-tree", "-r", commit, "--", *paths, repo=repo).splitlines()
    code = [line for line in listing if "/results/" not in line.split("\t", 1)[1]]
    return hashlib.sha256("\n".join(code).encode()).hexdigest()


def script_in_repo(command: list[str]) -> str:
    """The recipe script of a recorded command, relative to the repository it ran in."""
    for word in command[1:]:
        parts = Path(word).parts
        if word.endswith(".py") and "recipes" in parts:
            return str(Path(*parts[parts.index("recipes") :]))
    raise ValueError(f"no recipes/*.py script in the command {shlex.join(command)!r}")


def replay_command(
    command: list[str], worktree: Path, output_dir: Path, overrides: list[str], repo: Path = REPO
) -> list[str]:
    """The recorded command, run from ``worktree`` with ``overrides`` (the sweep's arguments
    now, how many steps) after the record's: later flags win in HfArgumentParser. A path under
    the checkout the record ran in (a pretrained model under its ``runs/``) is read from
    ``repo``: that checkout may have been a scratch clone, gone since."""
    script = script_in_repo(command)
    at = command.index(next(w for w in command if w.endswith(script)))
    recorded_root = command[at][: -len(script)]  # "/old/checkout/" or "" for a relative script
    return [
        sys.executable,
        str(worktree / script),
        *(
            str(repo / word[len(recorded_root) :])
            if recorded_root.startswith("/") and word.startswith(recorded_root)
            else word
            for word in command[at + 1 :]
        ),
        *overrides,
        *("--output_dir", str(output_dir), "--max_eval_samples", "32"),
        *("--save_strategy", "no", "--report_to", "none"),
    ]


def first_steps(steps: int) -> list[str]:
    """Overrides for a short run with the loss of every step (its schedule is ``steps`` long)."""
    return ["--max_steps", str(steps), "--logging_steps", "1"]


class Worktrees:
    """A detached worktree per commit under ``root``, made once and removed by ``close``."""

    def __init__(self, root: Path, repo: Path = REPO):
        self.root, self.repo, self.made = root, repo, {}
        self.lock = threading.Lock()  # two replays may ask for HEAD's at once

    def get(self, commit: str) -> Path:
        full = _git("rev-parse", commit, repo=self.repo)
        with self.lock:
            return self._get(full)

    def _get(self, full: str) -> Path:
        if full not in self.made:
            path = self.root / full[:12]
            if not path.exists():
                _git("worktree", "add", "--detach", "--force", str(path), full, repo=self.repo)
            self.made[full] = path
        return self.made[full]

    def close(self) -> None:
        for path in self.made.values():
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(path)], cwd=self.repo, check=False
            )
        subprocess.run(["git", "worktree", "prune"], cwd=self.repo, check=False)


def run_steps(
    command: list[str], worktree: Path, scratch: Path, threads: int, overrides: list[str]
) -> dict:
    """Run ``command`` from ``worktree``; the fields of its results file that the verdict
    compares, or ``{"error": <log tail>}``."""
    output_dir = Path(tempfile.mkdtemp(dir=scratch))
    env = {
        **os.environ,
        "PYTHONPATH": str(worktree),  # before the editable install: the worktree's hf_actq
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    argv = replay_command(command, worktree, output_dir, overrides)
    done = subprocess.run(argv, cwd=worktree, env=env, capture_output=True, text=True)
    path = output_dir / "actq_results.json"
    if done.returncode != 0 or not path.exists():
        return {"error": (done.stdout + done.stderr)[-1500:]}
    results = json.loads(path.read_text())
    return {
        "losses": [loss for _, loss in results.get("loss_history", [])],
        "activation_bytes_step0": results.get("activation_bytes_step0"),
        "step_peak_bytes": results.get("step_peak_bytes"),
    }


_SWEEPS: dict[Path, dict] = {}
_SWEEPS_LOCK = threading.Lock()


SWEEPS = ("sweep.py", "convergence.py")  # the drivers that give recipes names (RECIPES)


def sweep_arguments(result: dict, script: str, worktree: Path) -> list[str] | None:
    """The arguments the sweep beside ``script`` (its ``RECIPES``, in ``worktree``) gives the
    result's sweep recipe now: [] for a result no sweep made, None for a recipe it retired."""
    folder = worktree / Path(script).parent
    sweep = next((folder / name for name in SWEEPS if (folder / name).exists()), None)
    recipe = result.get("sweep_recipe")
    if recipe is None or sweep is None:
        return []
    with _SWEEPS_LOCK:
        if sweep not in _SWEEPS:
            spec = importlib.util.spec_from_file_location(f"_sweep_{len(_SWEEPS)}", sweep)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _SWEEPS[sweep] = module.RECIPES
    arguments = _SWEEPS[sweep].get(recipe)
    return None if arguments is None else list(arguments)


def verdict(then: dict, now: dict, steps: int) -> str:
    if any("error" in run or len(run["losses"]) != steps for run in (then, now)):
        return "failed"
    if then["losses"] != now["losses"]:
        return "changed"
    memory = ("activation_bytes_step0", "step_peak_bytes")
    return "same" if all(then[k] == now[k] for k in memory) else "memory changed"


def content_key(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def replayable(commit: str | None, repo: Path = REPO) -> bool:
    """Whether the commit a result names (``+`` marks a dirty tree) is in ``repo``."""
    commit = (commit or "").rstrip("+")
    check = ["git", "cat-file", "-e", f"{commit}^{{commit}}"]
    return bool(commit) and not subprocess.run(check, cwd=repo, capture_output=True).returncode


def replay(
    path: Path, steps: int, threads: int, worktrees: Worktrees, scratch: Path, prefix=False
) -> dict:
    result = json.loads(path.read_text())
    named, command = result.get("commit"), result.get("command")
    row = {"commit": named, "steps": steps, "threads": threads}
    commit = (named or "").rstrip("+")
    if not commit:
        row["verdict"] = "no commit"
    elif not replayable(named, worktrees.repo):
        row["verdict"] = "commit missing"
    if "verdict" in row and not prefix:
        return row
    argv = shlex.split(command)
    paths = code_paths(script_in_repo(argv))
    head = _git("rev-parse", "--short", "HEAD", repo=worktrees.repo)
    row["head"] = head
    present = sweep_arguments(result, script_in_repo(argv), worktrees.get(head))
    if "verdict" in row:  # no commit to replay: HEAD's first logged steps against the record
        return {**row, **first_logged_steps(result, argv, present, threads, worktrees, scratch)}
    if code_digest(commit, paths, worktrees.repo) == code_digest(head, paths, worktrees.repo):
        return {**row, "verdict": "same code"}
    if present is None:
        return {**row, "verdict": "retired"}
    then = run_steps(argv, worktrees.get(commit), scratch, threads, first_steps(steps))
    now = run_steps(argv, worktrees.get(head), scratch, threads, present + first_steps(steps))
    return {
        **row,
        "verdict": verdict(then, now, steps),
        "present_arguments": present,
        "then": then,
        "now": now,
    }


def first_logged_steps(result, argv, present, threads, worktrees, scratch) -> dict:
    """For a result whose commit cannot be replayed: rerun at HEAD up to its first logged loss
    with the full run's schedule (``--stop_after_steps``), and compare that loss, the activation
    bytes and the peak with the record, bit for bit. Only a run on the record's thread count can
    match: a float sum's order follows the threads. MiniLM's GLUE baselines (one thread, as the
    sweep runs them) match to the bit after 50 steps; "fewbit" at 3 and at 4 bits differ by
    7e-6 (relative) there, so no tolerance would tell a changed recipe from rounding."""
    if present is None:
        return {"verdict": "retired"}
    history = result.get("loss_history") or []
    if not history:
        return {"verdict": "failed", "now": {"error": "the result logs no loss"}}
    steps = int(history[0][0])
    overrides = [*present, "--stop_after_steps", str(steps)]
    now = run_steps(argv, worktrees.get("HEAD"), scratch, threads, overrides)
    recorded = {
        "losses": [history[0][1]],
        "activation_bytes_step0": result.get("activation_bytes_step0"),
        "step_peak_bytes": result.get("step_peak_bytes"),
    }
    row = {"prefix_steps": steps, "present_arguments": present, "then": recorded, "now": now}
    if "error" in now or len(now["losses"]) != 1:
        return {**row, "verdict": "failed"}
    difference = abs(now["losses"][0] - recorded["losses"][0]) / abs(recorded["losses"][0])
    row["relative_difference"] = difference
    if difference:
        return {**row, "verdict": "prefix changed"}
    memory = ("activation_bytes_step0", "step_peak_bytes")
    same = all(now[k] == recorded[k] for k in memory)
    return {**row, "verdict": "prefix same" if same else "prefix memory changed"}


def is_current(path: Path, row: dict, head: str, prefix: bool, repo: Path = REPO) -> bool:
    """Whether ``row``, the record of ``path``'s last replay, still holds at ``head``: the same
    file, replayed at a commit whose code is ``head``'s. A replay that failed tells nothing
    about the result (a path that moved, a run that was killed): it is tried again."""
    if row.get("content") != content_key(path) or row.get("verdict") == "failed":
        return False
    result = json.loads(path.read_text())
    if not replayable(result.get("commit"), repo):
        # Without --prefix such a result can only be marked "no commit", which would overwrite
        # what a --prefix run found: any row stands. With --prefix, only a prefix verdict does.
        if not prefix:
            return True
        if row.get("verdict") in ("no commit", "commit missing"):
            return False
    paths = code_paths(script_in_repo(shlex.split(result["command"])))
    return "head" in row and code_digest(row["head"], paths, repo) == code_digest(head, paths, repo)


def results_with_commands(targets: list[Path]) -> list[Path]:
    files = []
    for target in targets:
        candidates = sorted(target.rglob("*.json")) if target.is_dir() else [target]
        for path in candidates:
            if path.name == RECORD_NAME:
                continue
            try:
                data = json.loads(path.read_text())
            except ValueError:
                continue
            if isinstance(data, dict) and "command" in data:
                files.append(path)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="+", type=Path, help="results files or directories")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps to replay")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per run")
    parser.add_argument(
        "--prefix",
        action="store_true",
        help="for a result whose commit is unknown: rerun HEAD to its first logged loss",
    )
    parser.add_argument("--jobs", type=int, default=2, help="results replayed at once")
    parser.add_argument("--record", type=Path, help=f"default: <first directory>/{RECORD_NAME}")
    parser.add_argument("--workdir", type=Path, help="worktrees and run outputs (default: temp)")
    args = parser.parse_args(argv)

    first = args.targets[0] if args.targets[0].is_dir() else args.targets[0].parent
    record_path = args.record or first / RECORD_NAME
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    head = _git("rev-parse", "--short", "HEAD")
    files = results_with_commands(args.targets)

    def key(path: Path) -> str:
        path = path.resolve()
        return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)

    todo = [
        path for path in files if not is_current(path, record.get(key(path), {}), head, args.prefix)
    ]
    print(f"{len(files)} results with a command; {len(todo)} to replay at HEAD {head}", flush=True)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hf_actq_replay_"))
    workdir.mkdir(parents=True, exist_ok=True)
    worktrees = Worktrees(workdir / "worktrees")

    def one(path: Path) -> tuple[Path, dict]:
        return path, replay(path, args.steps, args.threads, worktrees, workdir, args.prefix)

    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            for done in as_completed([pool.submit(one, path) for path in todo]):
                path, row = done.result()
                record[key(path)] = {**row, "content": content_key(path)}
                record_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
                print(f"{key(path)}: {row['verdict']}", flush=True)
    finally:
        worktrees.close()
    counts: dict[str, int] = {}
    for path in files:
        verdict_ = record.get(key(path), {}).get("verdict", "not replayed")
        counts[verdict_] = counts.get(verdict_, 0) + 1
    print(", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
