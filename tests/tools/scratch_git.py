"""A scratch git repository for the tools' tests: what commits a result names, and what changed
since, are the tools' subject."""

import subprocess

ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
ENV |= {"GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}


def git(repo, *args) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, env=ENV, capture_output=True, text=True, check=True
    ).stdout.strip()


def new_repo(path):
    path.mkdir(exist_ok=True)
    git(path, "init", "-q")
    return path


def commit(repo, files: dict, message: str = "change") -> str:
    """Write ``files`` (name -> text), commit them, and return the short hash."""
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "--short", "HEAD")
