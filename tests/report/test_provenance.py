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


def test_a_copy_sent_to_a_gpu_names_the_commit_it_is_given(tmp_path, monkeypatch):
    # A lent GPU gets a copy of the working tree, without .git or (as on 2026-12-04) with a
    # .git of the device's own making: the sender names the commit, and that name wins.
    (tmp_path / "hf_actq").mkdir()
    monkeypatch.delenv("HF_ACTQ_COMMIT", raising=False)
    assert checkout_commit(tmp_path) is None
    monkeypatch.setenv("HF_ACTQ_COMMIT", "e2a0486")
    assert checkout_commit(tmp_path) == "e2a0486"
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(
        tmp_path,
        "-c",
        "user.name=x",
        "-c",
        "user.email=x@x",
        "commit",
        "-qm",
        "device's",
        "--allow-empty",
    )
    assert checkout_commit(tmp_path) == "e2a0486"
    monkeypatch.delenv("HF_ACTQ_COMMIT")
    assert checkout_commit(tmp_path) not in (None, "e2a0486")  # git's own commit
