"""benchmarks.report.publish: a run replaces its area's block in BENCHMARKS.md in place, on a real file."""

from __future__ import annotations

import re

import pytest

from benchmarks import report
from benchmarks.report import command_line, publish, table

RECORD = """# Gaggle benchmarks

## Engine

<!-- bench:engine -->
| batch | tok/s |
|---|---|
| 1 | 700 |

Command: `old engine` · commit 0000000 · 2026-01-01 · old machine
<!-- /bench:engine -->

Prose under the engine's block stays.

## Sampler

<!-- bench:sampler -->
old sampler table
<!-- /bench:sampler -->
"""


@pytest.fixture(autouse=True)
def fixed_stamp(monkeypatch):
    monkeypatch.setattr(report, "commit", lambda: "abc1234")
    monkeypatch.setattr(report, "machine", lambda: "NVIDIA H200, 16 cores")


def test_a_run_replaces_its_area_and_leaves_the_rest(tmp_path, capsys):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(RECORD)
    body = table("Decode", ["batch", "tok/s"], [[1, 738], [1024, "83,600"]])
    publish("engine", "python -m benchmarks.engine --shapes 1.5b", body, str(path))
    text = path.read_text()
    block = text[text.index("<!-- bench:engine -->"):text.index("<!-- /bench:engine -->")]
    assert block.startswith("<!-- bench:engine -->\n### Decode\n")  # the table first, the stamp last
    assert re.search(r"\|\n\nCommand: `python -m benchmarks.engine --shapes 1.5b` · commit abc1234 · "
                     r"\d{4}-\d\d-\d\d · NVIDIA H200, 16 cores\n$", block)
    assert "| 1024 | 83,600 |" in block and "old engine" not in text and "| 1 | 700 |" not in text
    assert text.count("<!-- bench:engine -->") == 1 and text.count("## Engine") == 1
    assert "Prose under the engine's block stays." in text and "old sampler table" in text  # other areas untouched
    assert "| 1024 | 83,600 |" in capsys.readouterr().out  # printed too
    publish("engine", "again", "second run\n", str(path))  # a second run replaces the first, not beside it
    text = path.read_text()
    assert "second run" in text and "83,600" not in text and text.count("<!-- /bench:engine -->") == 1
    assert text.startswith("# Gaggle benchmarks\n") and text.endswith("<!-- /bench:sampler -->\n")


def test_an_area_without_markers_gets_a_section_at_the_end(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(RECORD)
    publish("cold-start", "bash benchmarks/run.sh serve", "| s |\n|---|\n| 336 |\n", str(path), title="Cold start")
    text = path.read_text()
    assert text.startswith(RECORD.rstrip("\n") + "\n\n## Cold start\n\n<!-- bench:cold-start -->\n| s |\n")
    assert text.endswith("· NVIDIA H200, 16 cores\n<!-- /bench:cold-start -->\n")
    publish("cold-start", "again", "| s |\n|---|\n| 12 |\n", str(path))  # now it has markers: replaced
    text = path.read_text()
    assert text.count("## Cold start") == 1 and "| 12 |" in text and "| 336 |" not in text


def test_a_missing_file_is_created_and_dash_prints_only(tmp_path):
    path = tmp_path / "new.md"
    publish("redis", "cmd", "body\n", str(path))
    assert path.read_text().startswith("## redis\n\n<!-- bench:redis -->\nbody\n\nCommand: `cmd`")
    publish("redis", "cmd", "body\n", "-")
    assert not (tmp_path / "-").exists()


def test_a_broken_block_is_an_error_not_a_truncation(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("<!-- bench:engine -->\nno end marker\n")
    with pytest.raises(ValueError, match="no <!-- /bench:engine -->"):
        publish("engine", "cmd", "body", str(path))
    assert path.read_text() == "<!-- bench:engine -->\nno end marker\n"
    with pytest.raises(ValueError, match="area must be"):
        publish("Engine table", "cmd", "body", str(path))


def test_the_command_line_quotes_only_what_a_shell_would_split():
    assert command_line("benchmarks.engine", ["--serve", "--workload", "1 stream", "--api-key", "…"]) == \
        "python -m benchmarks.engine --serve --workload '1 stream' --api-key …"


def test_the_stamp_names_a_commit_and_a_machine(monkeypatch):
    monkeypatch.undo()
    monkeypatch.setenv("GAGGLE_COMMIT", "feed123")
    assert report.commit() == "feed123"
    assert report.machine().count("cores") == 1


def test_served_rows_put_each_served_run_against_engine_only(tmp_path):
    import orjson

    from benchmarks.served import main
    config = {"num_prompts": 1024, "input_len": 128, "output_len": 256, "max_concurrency": 256, "request_rate": "inf",
              "temperature": 1.0, "ignore_eos": True}
    metrics = {"output_throughput": 45000.0, "median_ttft_ms": 98.3, "p99_ttft_ms": 360.2, "median_itl_ms": 4.15,
               "p99_itl_ms": 9.0}
    poisson = {**config, "num_prompts": 2048, "request_rate": 233}
    for name, result in (("s256", {"mode": "served", "config": config, "metrics": metrics}),
                         ("s256-engine", {"mode": "engine-only", "config": config,
                                          "metrics": {**metrics, "output_throughput": 50000.0}}),
                         ("poisson", {"mode": "served", "config": poisson, "metrics": metrics})):
        (tmp_path / f"{name}.json").write_bytes(orjson.dumps(result))
    out = tmp_path / "BENCHMARKS.md"
    paths = [str(tmp_path / f"{n}.json") for n in ("s256", "s256-engine", "poisson")]
    assert main([*paths, "--note", "Service: `gaggle up`.", "--out", str(out)]) == 0
    text = out.read_text()
    assert "<!-- bench:served -->\nService: `gaggle up`. Load: 128-token prompts, 256 output tokens, T=1, " \
           "`--ignore-eos`.\n\n| load |" in text
    assert "| 256 streams (`--num-prompts 1024 --max-concurrency 256`) | 45,000 | 50,000 | 0.900 | 98.3 / 360.2 | " \
           "98.3 / 360.2 | 4.15 |" in text
    assert "| Poisson 233 requests/s, ≤ 256 in flight (`--num-prompts 2048 --max-concurrency 256 --request-rate 233`) " \
           "| 45,000 | – | – |" in text
