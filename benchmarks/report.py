"""Benchmark reports: markdown tables, printed, and put in BENCHMARKS.md in place of the area's last ones.

BENCHMARKS.md is the current record, not a log: each area's tables sit between ``<!-- bench:AREA -->`` and
``<!-- /bench:AREA -->``, and a run replaces them with its own, ending with a line that says the command, the
commit, the date and the machine. No torch here (the load tools run on machines without it).

    python -m benchmarks.report AREA "COMMAND" < body.md      # publish a table a script made
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the areas BENCHMARKS.md keeps a block for (any other name gets a new section at the end)
AREAS = ("engine", "sampler", "serving-loop", "served", "batch", "redis", "accept-rate", "constrained",
         "cold-start", "prefix-cache")
_AREA = re.compile(r"[a-z0-9][a-z0-9-]*")
_SHELL_SPECIAL = re.compile(r"[\s'\"$`\\|&;<>()*?!#~]")


def table(title: str, header: list[str], rows: list[list]) -> str:
    """A markdown table under a ``###`` heading."""
    return f"### {title}\n\n" + markdown_table(header, rows)


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def command_line(module: str, argv: list[str] | None) -> str:
    """How a ``python -m module`` run was started (``argv`` None: this process's own arguments); an argument is
    quoted only where a shell would split or expand it."""
    args = ["python", "-m", module, *(sys.argv[1:] if argv is None else argv)]
    return " ".join(shlex.quote(a) if not a or _SHELL_SPECIAL.search(a) else a for a in args)


def publish(area: str, command: str, body: str, out: str, title: str | None = None) -> str:
    """Print ``body`` and a last line naming ``command``, the commit, the date and the machine, and put the same
    between ``area``'s markers in ``out`` (replacing what was there; a new ``## title`` section at the end where
    the markers are missing); ``out`` '-': print only. Returns the block."""
    if not _AREA.fullmatch(area):
        raise ValueError(f"area must be lowercase letters, digits and dashes, got {area!r}")
    stamp = f"Command: `{command}` · commit {commit()} · {date.today()} · {machine()}"
    block = f"{body.strip()}\n\n{stamp}\n"
    print(block)
    if out != "-":
        path = Path(out)
        text = path.read_text() if path.exists() else ""
        path.write_text(replace_block(text, area, block, title or area))
    return block


def replace_block(text: str, area: str, block: str, title: str) -> str:
    """``text`` with ``area``'s block replaced by ``block`` (or, without its markers, a section appended)."""
    start, end = f"<!-- bench:{area} -->", f"<!-- /bench:{area} -->"
    i = text.find(start)
    if i < 0:
        section = f"## {title}\n\n{start}\n{block}{end}\n"
        return (text.rstrip("\n") + "\n\n" + section) if text.strip() else section
    j = text.find(end, i)
    if j < 0:
        raise ValueError(f"{start} has no {end} after it: fix the file before publishing into it")
    return text[:i + len(start)] + "\n" + block + text[j:]


def commit() -> str:
    """The short commit of this checkout, '+' if tracked files differ from it ($GAGGLE_COMMIT where there is no
    git: a copy of the tree on a GPU host)."""
    if os.environ.get("GAGGLE_COMMIT"):
        return os.environ["GAGGLE_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+" if dirty else "")


def machine() -> str:
    """The GPUs (nvidia-smi), else the CPU model; the core count; torch's version where the run imported it."""
    cores = f"{os.cpu_count()} cores"
    if "torch" in sys.modules:
        cores += f", torch {sys.modules['torch'].__version__}"
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=10).stdout.split("\n")
        names = [n.strip() for n in names if n.strip()]
    except (OSError, subprocess.SubprocessError):
        names = []
    if names:
        return f"{len(names)} × {names[0]}, {cores}" if len(names) > 1 else f"{names[0]}, {cores}"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {cores}"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {cores}"


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("area")
    ap.add_argument("command", help="the command that made the body")
    ap.add_argument("--title", help="the section's heading if the area has no block yet")
    ap.add_argument("--out", default="BENCHMARKS.md", help="'-': print only")
    args = ap.parse_args(argv)
    publish(args.area, args.command, sys.stdin.read(), args.out, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
