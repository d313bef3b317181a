"""A pytest plugin for the GPU check: one JSON line per test outcome, appended as each test ends,
to the file ``HF_ACTQ_TEST_LINES`` names, so that a run stopped by its time budget still says
what it ran (pytest's own reports are written only when the session ends)."""

import json
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("HF_ACTQ_TEST_LINES")
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    message = ""
    if report.failed:
        # The assertion's lines and where it failed (the last line, "file:line: Error"): one
        # "E" line alone said "where ... = torch.equal" and nothing of which comparison failed.
        lines = str(report.longrepr).strip().splitlines()
        errors = [line for line in lines if line.startswith("E ")][:12]
        message = "\n".join([*errors, lines[-1]])
    line = {
        "test": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "seconds": round(report.duration, 3),
        "message": message[:1500],
    }
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(line) + "\n")
