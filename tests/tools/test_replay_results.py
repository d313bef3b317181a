"""tools/replay_results.py on a small git repository made here, with a stand-in recipe whose
losses and bytes come from the package: each verdict is reached by the change that should reach
it, and tools/results_age.py ages a result replayed "same" from the commit it was replayed at."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scratch_git

import replay_results  # noqa: E402
import results_age  # noqa: E402
from scratch_git import commit as _commit  # noqa: E402
from scratch_git import new_repo  # noqa: E402

# Writes what recipes/*/run.py write: a loss per logged step, the activation bytes, the peak.
RUN_PY = """
import argparse, json, pathlib
import hf_actq
parser = argparse.ArgumentParser()
parser.add_argument("--output_dir")
parser.add_argument("--max_steps", type=int, default=10)
parser.add_argument("--seed", type=int)
parser.add_argument("--scale", type=float)
parser.add_argument("--stop_after_steps", type=int)
args, _ = parser.parse_known_args()
scale = hf_actq.SCALE if args.scale is None else args.scale
history = [[s, scale / s] for s in range(1, args.max_steps + 1)]
if args.stop_after_steps:  # the first logged loss of the full run
    history = [[args.stop_after_steps, scale / args.stop_after_steps]]
out = pathlib.Path(args.output_dir)
out.mkdir(parents=True, exist_ok=True)
(out / "actq_results.json").write_text(json.dumps({
    "loss_history": history,
    "activation_bytes_step0": hf_actq.BYTES,
    "step_peak_bytes": 1000,
}))
"""


def _verdict(repo, result, tmp_path, prefix=False) -> dict:
    worktrees = replay_results.Worktrees(tmp_path / "worktrees", repo)
    try:
        return replay_results.replay(result, 2, 1, worktrees, tmp_path, prefix)
    finally:
        worktrees.close()


def test_each_verdict_and_the_age_it_gives(tmp_path):
    repo = new_repo(tmp_path / "repo")
    made = _commit(
        repo, {"hf_actq/__init__.py": "SCALE = 1.0\nBYTES = 100\n", "recipes/demo/run.py": RUN_PY}
    )
    result = repo / "recipes/demo/results/r.json"
    command = f"python {repo}/recipes/demo/run.py --seed 0 --output_dir runs/r"
    _commit(repo, {str(result.relative_to(repo)): json.dumps({"commit": made, "command": command})})

    _commit(repo, {"README.md": "docs\n"})
    assert _verdict(repo, result, tmp_path)["verdict"] == "same code"

    head = _commit(repo, {"hf_actq/__init__.py": "# why\nSCALE = 1.0\nBYTES = 100\n"})
    row = _verdict(repo, result, tmp_path)
    assert (row["verdict"], row["head"]) == ("same", head)
    assert (
        row["then"]
        == row["now"]
        == {
            "losses": [1.0, 0.5],
            "activation_bytes_step0": 100,
            "step_peak_bytes": 1000,
        }
    )
    # Recorded beside the results, the replay ages the result from the commit it ran at.
    record = {str(result.relative_to(repo)): {**row, "content": replay_results.content_key(result)}}
    (result.parent / "replays.json").write_text(json.dumps(record))
    _commit(repo, {"recipes/demo/results/replays.json": json.dumps(record)})
    age = results_age.age(result, "hf_actq", repo)
    assert (age["commit"], age["commit_from"], age["code_commits_since"]) == (
        head,
        "replayed the same",
        0,
    )
    assert [p.name for p in results_age.results_files(repo)] == ["r.json"]

    _commit(repo, {"hf_actq/__init__.py": "SCALE = 1.0\nBYTES = 90\n"})
    assert _verdict(repo, result, tmp_path)["verdict"] == "memory changed"
    _commit(repo, {"hf_actq/__init__.py": "SCALE = 2.0\nBYTES = 100\n"})
    row = _verdict(repo, result, tmp_path)
    assert (row["verdict"], row["then"]["losses"], row["now"]["losses"]) == (
        "changed",
        [1.0, 0.5],
        [2.0, 1.0],
    )
    # The replayed "same" no longer holds for the result's age once the package changed since.
    assert results_age.age(result, "hf_actq", repo)["code_commits_since"] == 2

    _commit(repo, {"hf_actq/__init__.py": "raise ImportError('broken')\n"})
    row = _verdict(repo, result, tmp_path)
    assert row["verdict"] == "failed" and "broken" in row["now"]["error"]
    # A failure tells nothing about the result: the next replay at this commit tries again,
    # where a verdict at this commit stands.
    row = {**row, "content": replay_results.content_key(result)}
    assert not replay_results.is_current(result, row, row["head"], False, repo)
    assert replay_results.is_current(
        result, {**row, "verdict": "changed"}, row["head"], False, repo
    )


def test_a_sweep_result_is_replayed_as_the_sweep_runs_its_recipe_now(tmp_path):
    repo = new_repo(tmp_path / "repo")
    made = _commit(
        repo, {"hf_actq/__init__.py": "SCALE = 1.0\nBYTES = 1\n", "recipes/demo/run.py": RUN_PY}
    )
    command = f"python {repo}/recipes/demo/run.py"
    pinned = repo / "pinned.json"
    pinned.write_text(json.dumps({"commit": made, "command": command, "sweep_recipe": "a"}))
    gone = repo / "gone.json"
    gone.write_text(json.dumps({"commit": made, "command": command, "sweep_recipe": "gone"}))
    # The package's default moves; the sweep pins recipe "a" to what it meant, retires "gone".
    sweep = "RECIPES = {'a': ['--scale', '1.0'], 'gone': None}\n"
    _commit(
        repo, {"hf_actq/__init__.py": "SCALE = 2.0\nBYTES = 1\n", "recipes/demo/sweep.py": sweep}
    )
    row = _verdict(repo, pinned, tmp_path)
    assert (row["verdict"], row["present_arguments"]) == ("same", ["--scale", "1.0"])
    assert _verdict(repo, gone, tmp_path)["verdict"] == "retired"


def test_results_without_a_usable_commit_are_not_run(tmp_path):
    repo = new_repo(tmp_path / "repo")
    _commit(repo, {"hf_actq/__init__.py": "SCALE = 1.0\n"})
    command = f"python {repo}/recipes/demo/run.py"
    nameless = repo / "a.json"
    nameless.write_text(json.dumps({"command": command}))
    assert _verdict(repo, nameless, tmp_path)["verdict"] == "no commit"
    elsewhere = repo / "b.json"
    elsewhere.write_text(json.dumps({"command": command, "commit": "1234567+"}))
    assert _verdict(repo, elsewhere, tmp_path)["verdict"] == "commit missing"


def test_a_result_without_its_commit_is_checked_against_its_first_logged_loss(tmp_path):
    repo = new_repo(tmp_path / "repo")
    # HEAD's first logged loss (at step 5) is 1 / 5.
    code = "SCALE = 1.0\nBYTES = 100\n"
    _commit(repo, {"hf_actq/__init__.py": code, "recipes/demo/run.py": RUN_PY})
    command = f"python {repo}/recipes/demo/run.py"
    memory = {"activation_bytes_step0": 100, "step_peak_bytes": 1000}
    verdicts = {}
    for first_loss in (0.2, 0.2000001):
        nameless = repo / f"{first_loss}.json"
        record = {"command": command, "loss_history": [[5, first_loss], [10, 0.1]], **memory}
        nameless.write_text(json.dumps(record))
        row = _verdict(repo, nameless, tmp_path, prefix=True)
        verdicts[first_loss] = row["verdict"]
        assert row["prefix_steps"] == 5 and row["now"]["losses"] == [1.0 / 5]
    # Bit for bit: 5e-7 apart is a changed run (fewbit's 3 and 4 bits differ by 7e-6).
    assert verdicts == {0.2: "prefix same", 0.2000001: "prefix changed"}


def test_a_run_without_prefix_keeps_what_a_prefix_run_found(tmp_path):
    repo = new_repo(tmp_path / "repo")
    made = _commit(
        repo, {"hf_actq/__init__.py": "SCALE = 1.0\nBYTES = 100\n", "recipes/demo/run.py": RUN_PY}
    )
    nameless = repo / "nameless.json"
    nameless.write_text(json.dumps({"command": f"python {repo}/recipes/demo/run.py"}))
    content = replay_results.content_key(nameless)
    found = {"verdict": "prefix same", "head": made, "content": content}
    unchecked = {"verdict": "no commit", "content": content}
    head = _commit(repo, {"hf_actq/__init__.py": "SCALE = 1.0\nBYTES = 90\n"})
    # Without --prefix, "no commit" is all a replay could say: the row stands, either way.
    assert replay_results.is_current(nameless, found, head, False, repo)
    assert replay_results.is_current(nameless, unchecked, head, False, repo)
    # With --prefix, a row from a run without it is checked, and so is one made at other code.
    assert not replay_results.is_current(nameless, unchecked, head, True, repo)
    assert not replay_results.is_current(nameless, found, head, True, repo)
    assert replay_results.is_current(nameless, {**found, "head": head}, head, True, repo)
    # An edited result is replayed whatever its row says.
    assert not replay_results.is_current(nameless, {**found, "content": "0"}, head, False, repo)


def test_the_replay_command_runs_the_worktree_script_with_the_overrides_last():
    recorded = "/venv/bin/python /old/checkout/recipes/glue/run.py --task_name mrpc --max_steps 9"
    overrides = replay_results.first_steps(2)
    argv = replay_results.replay_command(recorded.split(), Path("/wt"), Path("/out"), overrides)
    assert argv[1:4] == ["/wt/recipes/glue/run.py", "--task_name", "mrpc"]
    # argparse keeps the last value of a repeated flag: the overrides come after the record's.
    assert (
        argv.index("--max_steps", 5) > argv.index("9")
        and argv[argv.index("2") - 1] == "--max_steps"
    )


def test_paths_under_the_recorded_checkout_are_read_from_this_one():
    # A result made in a scratch clone names that clone's pretrained model; the clone is gone.
    recorded = (
        "/venv/bin/python /scratch/clone/recipes/llama_lora/run.py --model_name_or_path "
        "/scratch/clone/runs/pretrain/model --data_path /shared/alpaca.json --seed 0"
    )
    argv = replay_results.replay_command(
        recorded.split(), Path("/wt"), Path("/out"), [], repo=Path("/here")
    )
    assert argv[1:7] == [
        "/wt/recipes/llama_lora/run.py",
        "--model_name_or_path", "/here/runs/pretrain/model",
        "--data_path", "/shared/alpaca.json",  # outside the checkout: as recorded
        "--seed",
    ]  # fmt: skip
