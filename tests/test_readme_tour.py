"""README.md's set-up commands are there and its tour runs: every fenced block marked ``<!-- tour -->`` is run, in
order, against a live CPU ``gaggle up`` (demo model) on free ports. The blocks address the documented
``127.0.0.1:8000``; the test points that at its own port. Python blocks share one namespace, as pasted into one
interpreter; shell blocks run in bash and must print a JSON answer without an error."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.queue_helpers import REPO
from tests.test_up import start_up, wait_ready
from worker.redis_server import free_port

README = Path(REPO, "README.md")
DOCUMENTED = "127.0.0.1:8000"
FENCE = re.compile(r"^```(\w*)\s*$")


def fenced_blocks(text: str) -> list[tuple[int, str, str, bool]]:
    """(line number, language, code, marked as the tour) of every fenced block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        marked = any(lines[j].strip() == "<!-- tour -->" for j in range(max(0, start - 3), start - 1))
        blocks.append((start, opening.group(1), "\n".join(body), marked))
        i += 1
    return blocks


def test_the_two_set_up_commands_are_documented():
    commands = [line.split("#")[0].strip() for _, lang, code, _ in fenced_blocks(README.read_text())
                if lang in ("bash", "sh", "") for line in code.splitlines()]
    assert "make up" in commands and "make test" in commands


def test_make_up_installs_the_service_without_the_test_tools(tmp_path):
    """What `make up` and `make test` would run in a fresh checkout (``make -n`` against a venv not made yet):
    the service's venv has gaggle and the openai SDK, not lm-eval, LangChain or Selenium."""
    def planned(target: str) -> str:
        done = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout
    up, test = planned("up"), planned("test")
    assert "-e '.[client]'" in up and ".[test]" not in up
    assert "-e '.[client]'" in test and "-e '.[test]'" in test


def test_the_tour_has_the_promised_parts():
    tour = "\n".join(code for _, _, code, marked in fenced_blocks(README.read_text()) if marked)
    for part in ("completions.create", "stream=True", "/requests", "batches.create", "json_schema", "tools=",
                 "curl"):
        assert part in tour, f"the tour lost its {part!r} example"


@pytest.mark.slow
def test_the_readme_tour_runs_against_gaggle_up(tmp_path, monkeypatch):
    tour = [(line, lang, code) for line, lang, code, marked in fenced_blocks(README.read_text()) if marked]
    assert len(tour) >= 5, "README.md lost its tour blocks (marked <!-- tour -->)"
    port = free_port()
    up = start_up(tmp_path / "data", port, "--api-workers", "1")
    monkeypatch.chdir(tmp_path)  # files the tour writes (requests.jsonl) land here
    try:
        wait_ready(port, timeout_s=180)
        namespace: dict = {"__name__": "__tour__"}
        for line, lang, code in tour:
            code = code.replace(DOCUMENTED, f"127.0.0.1:{port}")
            if lang == "python":
                exec(compile(code, f"README.md, tour block at line {line}", "exec"), namespace)
            elif lang in ("bash", "sh"):
                run = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True,
                                     timeout=60)
                assert run.returncode == 0, f"README.md line {line}: {run.stderr[-2000:]}"
                answer = json.loads(run.stdout)
                assert "error" not in answer, f"README.md line {line}: {answer}"
            else:
                raise AssertionError(f"README.md line {line}: a tour block in {lang!r}, which this test cannot run")
        assert namespace["batch"].status == "completed", namespace["batch"]
        assert namespace["answer"].choices[0].finish_reason == "tool_calls"
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
