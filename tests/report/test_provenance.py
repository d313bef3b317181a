import subprocess

from hf_actq.report.provenance import checkout_commit


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_a_written_results_file_does_not_mark_the_checkout_as_changed(tmp_path):
    files = [
        "hf_actq/ops.py",
        "benchmarks/results/bench.json",
        "recipes/glue/results/rte/a.json",
        "recipes/glue/README.md",
    ]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("0\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    clean = checkout_commit(tmp_path)
    assert clean and not clean.endswith("+")

    for name in files[1:]:  # what a benchmark or a recipe run writes (a sweep: its README too)
        (tmp_path / name).write_text("1\n")
    assert checkout_commit(tmp_path) == clean

    (tmp_path / files[0]).write_text("1\n")  # a code change
    assert checkout_commit(tmp_path) == clean + "+"
    assert checkout_commit(tmp_path, "benchmarks") == clean + "+"  # paths given: only those
    assert checkout_commit(tmp_path, "recipes/glue/results/rte") == clean + "+"


def test_a_copy_without_git_names_the_commit_it_is_given(tmp_path, monkeypatch):
    # A lent GPU gets the working tree without .git: the sender names the commit.
    (tmp_path / "hf_actq").mkdir()
    monkeypatch.delenv("HF_ACTQ_COMMIT", raising=False)
    assert checkout_commit(tmp_path) is None
    monkeypatch.setenv("HF_ACTQ_COMMIT", "e2a0486")
    assert checkout_commit(tmp_path) == "e2a0486"
    _git(tmp_path, "init", "-q")  # a checkout: git says, not the variable
    assert checkout_commit(tmp_path) is None  # no commit yet
