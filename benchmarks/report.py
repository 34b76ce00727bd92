"""Benchmark reports: markdown tables, printed and appended to BENCHMARKS.md (no torch here)."""

from __future__ import annotations

import sys
from datetime import date


def table(title: str, header: list[str], rows: list[list]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def publish(title: str, module: str, argv: list[str] | None, body: str, out: str) -> None:
    """Print a dated section with the command that made it; append it to ``out`` unless it is '-'."""
    cmd = f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])
    section = f"## {title}, {date.today()}\n\nCommand: `{cmd.strip()}`\n\n{body}"
    print(section)
    if out != "-":
        with open(out, "a") as f:
            f.write("\n" + section)
