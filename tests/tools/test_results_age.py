"""tools/results_age.py on a small git repository made here: results made before the code
changed are listed with how far behind they are."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scratch_git

import results_age  # noqa: E402
from scratch_git import commit as _commit  # noqa: E402
from scratch_git import new_repo  # noqa: E402


def test_results_are_aged_by_their_recorded_commit_or_their_last_change(tmp_path):
    new_repo(tmp_path)
    first = _commit(tmp_path, {"hf_actq/op.py": "a = 1\n"}, "code")
    # A result that names the commit it was made at, committed later (as the sweeps do).
    recorded = json.dumps({"provenance": {"commit": f"{first}+", "command": "bench"}})
    _commit(tmp_path, {"benchmarks/results/a.json": recorded}, "result a")
    _commit(tmp_path, {"hf_actq/op.py": "a = 2\n"}, "code changes")
    # A table that names no commit: aged from the commit that last changed it.
    _commit(tmp_path, {"recipes/glue/results/table.md": "| x |\n"}, "table")
    _commit(tmp_path, {"hf_actq/op.py": "a = 3\n", "hf_actq/new.py": "b = 1\n"}, "more code")
    _commit(tmp_path, {"README.md": "docs only\n"}, "docs")

    files = results_age.results_files(tmp_path)
    assert sorted(p.name for p in files) == ["a.json", "table.md"]
    a = results_age.age(tmp_path / "benchmarks/results/a.json", "hf_actq", tmp_path)
    assert (a["commit"], a["commit_from"]) == (first, "recorded")
    assert (a["code_commits_since"], a["code_files_changed"]) == (2, 2)
    table = results_age.age(tmp_path / "recipes/glue/results/table.md", "hf_actq", tmp_path)
    assert table["commit_from"] == "last change of the file"
    assert (table["code_commits_since"], table["code_files_changed"]) == (1, 2)


def test_a_report_written_beside_a_record_takes_its_commit_only_if_committed_with_it(tmp_path):
    new_repo(tmp_path)
    made_at = _commit(tmp_path, {"hf_actq/op.py": "a = 1\n"}, "code")
    record = json.dumps({"provenance": {"commit": made_at, "command": "hf-actq memory"}})
    report = "benchmarks/results/memory_x"
    files = {f"{report}/memory.json": record, f"{report}/memory.md": "| x |\n"}
    _commit(tmp_path, {**files, f"{report}/plan.json": "{}"}, "report")
    _commit(tmp_path, {"hf_actq/op.py": "a = 2\n"}, "code changes")
    # Re-run later: the record and the table change, the plan's contents do not.
    rerun_at = _commit(tmp_path, {"hf_actq/op.py": "a = 3\n"}, "more code")
    record = json.dumps({"provenance": {"commit": rerun_at, "command": "hf-actq memory"}})
    _commit(tmp_path, {f"{report}/memory.json": record, f"{report}/memory.md": "| y |\n"}, "rerun")

    table = results_age.age(tmp_path / report / "memory.md", "hf_actq", tmp_path)
    assert (table["commit"], table["commit_from"]) == (rerun_at, "recorded beside it")
    assert table["code_commits_since"] == 0
    plan = results_age.age(tmp_path / report / "plan.json", "hf_actq", tmp_path)
    assert plan["commit_from"] == "last change of the file"
    assert plan["code_commits_since"] == 2


def test_a_report_table_a_rerun_left_unchanged_takes_the_commit_of_the_record_it_shows(tmp_path):
    new_repo(tmp_path)
    made_at = _commit(tmp_path, {"hf_actq/op.py": "a = 1\n"}, "code")
    report = tmp_path / "benchmarks/results/memory_x"
    rows = [{"recipe": "baseline", "activation_bytes": 3 * 2**20, "peak_bytes": 5 * 2**30}]

    def record(commit, peak=5 * 2**30):
        rows[0]["peak_bytes"] = peak
        return json.dumps({"provenance": {"commit": commit}, "rows": rows})

    table = (
        "| recipe | activation memory | peak |\n|---|---:|---:|\n"
        "| baseline | 3.0 MiB | 5.00 GiB (backward) |\n"
    )
    name = "benchmarks/results/memory_x"
    written = _commit(
        tmp_path, {f"{name}/memory.json": record(made_at), f"{name}/memory.md": table}, "report"
    )
    rerun_at = _commit(tmp_path, {"hf_actq/op.py": "a = 2\n"}, "code changes")
    # Re-run: the record names the new commit; the table's bytes came out the same.
    _commit(tmp_path, {f"{name}/memory.json": record(rerun_at)}, "rerun")
    same = results_age.age(report / "memory.md", "hf_actq", tmp_path)
    assert (same["commit"], same["commit_from"]) == (rerun_at, "shows the record beside it")
    assert same["code_commits_since"] == 0
    # A record whose figures the table does not show does not vouch for it.
    _commit(tmp_path, {f"{name}/memory.json": record(rerun_at, peak=6 * 2**30)}, "other peak")
    stale = results_age.age(report / "memory.md", "hf_actq", tmp_path)
    assert (stale["commit"], stale["commit_from"]) == (written, "last change of the file")
    assert stale["code_commits_since"] == 1


def test_a_record_of_earlier_code_says_so_for_its_folder_and_other_results_do_not(tmp_path):
    new_repo(tmp_path)
    _commit(tmp_path, {"hf_actq/op.py": "a = 1\n"}, "code")
    before = "benchmarks/results/memory_before"
    kept = {"record": "the norms before they shared their input", "provenance": {}}
    files = {f"{before}/memory.json": json.dumps(kept), f"{before}/memory.md": "| x |\n"}
    files["benchmarks/results/now.json"] = json.dumps({"provenance": {"commit": "abc1234"}})
    _commit(tmp_path, files, "before and now")
    _commit(tmp_path, {"hf_actq/op.py": "a = 2\n"}, "code changes")

    for name in ("memory.json", "memory.md"):
        row = results_age.age(tmp_path / before / name, "hf_actq", tmp_path)
        assert row["record"] == "the norms before they shared their input"
        assert row["code_commits_since"] == 1  # still dated: a record, not a current result
    now = results_age.age(tmp_path / "benchmarks/results/now.json", "hf_actq", tmp_path)
    assert now["record"] == ""


def test_a_commit_that_changes_only_docstrings_comments_or_layout_does_not_age_a_result(tmp_path):
    new_repo(tmp_path)
    code = 'def f(x):\n    """Twice x."""\n    return 2 * x  # doubled\n'
    first = _commit(tmp_path, {"hf_actq/op.py": code, "hf_actq/data.txt": "a\n"}, "code")
    recorded = json.dumps({"provenance": {"commit": first, "command": "bench"}})
    _commit(tmp_path, {"benchmarks/results/a.json": recorded}, "result")
    reworded = 'def f(x):\n    """x, doubled."""\n\n    return 2*x  # times two\n'
    _commit(tmp_path, {"hf_actq/op.py": reworded}, "docstring, comment and layout")
    result = tmp_path / "benchmarks/results/a.json"
    row = results_age.age(result, "hf_actq", tmp_path)
    assert (row["code_commits_since"], row["code_files_changed"]) == (0, 0)
    anything = results_age.age(result, "hf_actq", tmp_path, any_change=True)
    assert (anything["code_commits_since"], anything["code_files_changed"]) == (1, 1)

    # A string that is not a docstring, and any change to a file that is not Python, count.
    _commit(tmp_path, {"hf_actq/op.py": reworded.replace("return", '"a"\n    return')}, "code")
    _commit(tmp_path, {"hf_actq/data.txt": "b\n"}, "data")
    row = results_age.age(result, "hf_actq", tmp_path)
    assert (row["code_commits_since"], row["code_files_changed"]) == (2, 2)


def test_a_rendered_table_is_as_old_as_the_oldest_result_it_shows(tmp_path, monkeypatch):
    new_repo(tmp_path)
    first = _commit(tmp_path, {"hf_actq/op.py": "a = 1\n"}, "code")
    second = _commit(tmp_path, {"hf_actq/op.py": "a = 2\n"}, "code changes")
    folder = "recipes/glue/results"
    made = {"rte/old.json": first, "rte/new.json": second}
    files = {f"{folder}/{n}": json.dumps({"commit": c, "command": "run"}) for n, c in made.items()}
    # A record of earlier code, in the same folder, does not age the table.
    kept = {"record": "before", "commit": "0000000"}
    files[f"{folder}/rte/before.json"] = json.dumps(kept)
    _commit(tmp_path, {**files, f"{folder}/table.md": "| rendered |\n"}, "results and table")
    _commit(tmp_path, {"hf_actq/op.py": "a = 3\n"}, "more code")
    monkeypatch.setattr(results_age, "RENDERED", (f"{folder}/table.md",))

    table = results_age.age(tmp_path / folder / "table.md", "hf_actq", tmp_path)
    assert (table["commit"], table["code_commits_since"]) == (first, 2)
    assert table["commit_from"] == "oldest of the 2 results it renders"
    assert table["file"] == f"{folder}/table.md"
