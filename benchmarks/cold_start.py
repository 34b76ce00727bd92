"""How long a started ``gaggle up`` takes to answer: seconds to ``/ready`` and to a first completion, and the
worker's warm-up by part (from its JSON log), as the cold-start table.

    gaggle up --model 1.5b.pth --data-dir D ... &   # started at S (epoch seconds)
    python -m benchmarks.cold_start --url http://127.0.0.1:8000 --started S --logs D/logs [--pid PID]

Cold means an empty Triton cache (``benchmarks/run.sh`` publishes only such a start; a warm one is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import orjson

from benchmarks.report import command_line, markdown_table, publish


def wait_ready(url: str, started: float, timeout_s: float, pid: int | None) -> float:
    """Seconds from ``started`` until ``/ready`` answers 200; RuntimeError if ``pid`` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
                if resp.status == 200:
                    return time.time() - started
        except OSError:
            pass
        if pid is not None and not _alive(pid):
            raise RuntimeError(f"gaggle up (pid {pid}) exited before it was ready")
        time.sleep(0.5)
    raise RuntimeError(f"{url}/ready did not answer within {timeout_s:.0f} s")


def first_answer(url: str, started: float) -> float:
    """Seconds from ``started`` until a short completion came back."""
    body = json.dumps({"model": "any", "prompt": "The goose", "max_tokens": 8}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as resp:
        resp.read()
    return time.time() - started


def warm_up_parts(logs: Path) -> tuple[float | None, dict[str, float]]:
    """The first worker's warm-up seconds ("engine warmed up") and its parts ("warm-up parts"), if it logged them."""
    total, parts = None, {}
    for path in sorted(logs.glob("worker-*.log"))[:1]:
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if entry.get("msg") == "engine warmed up":
                total = entry.get("seconds")
            elif entry.get("msg") == "warm-up parts":
                parts = {k: v for k, v in entry.items() if k != "ts" and isinstance(v, (int, float))}
    return total, parts


def render(ready_s: float, answer_s: float, total: float | None, parts: dict[str, float], cold: bool) -> str:
    start = "cold (empty Triton cache)" if cold else "warm (Triton cache kept)"
    rows = [[f"{start} `gaggle up` to the first answer", f"{answer_s:.0f}"],
            [f"{start} `gaggle up` to `/ready`", f"{ready_s:.0f}"]]
    if total is not None:
        rows.append(["the worker's warm-up (compile, autotune, capture)" + (", of which:" if parts else ""),
                     f"{total:.0f}"])
    rows += [[f"… {name.replace('_', ' ')}", f"{seconds:.1f}"]
             for name, seconds in sorted(parts.items(), key=lambda kv: -kv[1])]
    return markdown_table(["measure", "s"], rows)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--started", type=float, required=True, help="when gaggle up was started (epoch seconds)")
    ap.add_argument("--logs", type=Path, required=True, help="gaggle up's log folder (DATA_DIR/logs)")
    ap.add_argument("--pid", type=int, help="gaggle up's process: stop waiting if it exits")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds to wait for /ready")
    ap.add_argument("--warm", action="store_true", help="the Triton cache was not empty (label the rows so)")
    ap.add_argument("--note", default="", help="a paragraph above the table (e.g. the service's command line)")
    ap.add_argument("--command", help="what started the service, for the record (default: this command)")
    ap.add_argument("--out", default="BENCHMARKS.md", help="'-': print only")
    ap.add_argument("--area", default="cold-start", help="the BENCHMARKS.md block to replace")
    args = ap.parse_args(argv)
    url = args.url.rstrip("/")
    try:
        ready_s = wait_ready(url, args.started, args.timeout, args.pid)
        answer_s = first_answer(url, args.started)
    except (RuntimeError, OSError) as e:
        print(f"cold_start: {e}", file=sys.stderr)
        return 1
    body = render(ready_s, answer_s, *warm_up_parts(args.logs), cold=not args.warm)
    publish(args.area, args.command or command_line("benchmarks.cold_start", argv),
            (args.note.strip() + "\n\n" if args.note.strip() else "") + body, args.out, title="Cold start")
    return 0


if __name__ == "__main__":
    sys.exit(main())
