"""Start-up time of ``gaggle up``: from the command to the first answered request, cold and warm.

Cold: the data dir's compiled-kernel cache (``triton-cache``) removed first, as on a fresh machine; warm: the same
data dir again (a restart). Each run starts ``gaggle up`` in a session of its own, asks for an 8-token completion
every 0.25 s until one answers, reads the worker's warm-up stages from its log, and stops it with SIGINT.

    python -m benchmarks.startup --model 1.5b.pth [--runs cold,warm] [--up-arg=--worker-arg=--max-num-seqs=1024]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.report import markdown_table, publish


def _post(url: str, body: dict, timeout: float = 5.0) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def warm_up_stages(logs: Path) -> dict[str, float]:
    """The last ``warm-up stage done`` seconds of each stage in the worker logs (and the model's load)."""
    stages: dict[str, float] = {}
    for path in sorted(logs.glob("worker-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if '"warm-up stage done"' in line:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                stages[rec["stage"]] = rec["seconds"]
    return stages


def one_start(args: argparse.Namespace, cold: bool, port: int) -> dict:
    data_dir = Path(args.data_dir)
    if cold:
        shutil.rmtree(data_dir / "triton-cache", ignore_errors=True)
    shutil.rmtree(data_dir / "logs", ignore_errors=True)
    cmd = [sys.executable, "-m", "cli.main", "up", "--model", args.model, "--data-dir", str(data_dir),
           "--port", str(port), *args.up_arg]
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(data_dir / f"up-{port}.log", "w"),
                            start_new_session=True)
    ready_s = answer_s = None
    try:
        deadline = t0 + args.timeout
        while time.monotonic() < deadline and answer_s is None:
            if proc.poll() is not None:
                raise RuntimeError(f"gaggle up exited with {proc.returncode}")
            if "exited (" in (data_dir / f"up-{port}.log").read_text(errors="replace"):
                raise RuntimeError(f"a child of gaggle up exited: see {data_dir / f'up-{port}.log'} and its logs")
            if ready_s is None and _get(url + "/ready")[0] == 200:
                ready_s = time.monotonic() - t0
            if ready_s is not None and _post(url + "/v1/completions",
                                             {"model": args.model_name, "prompt": "Hello", "max_tokens": 8}) == 200:
                answer_s = time.monotonic() - t0
            time.sleep(0.25)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"ready_s": ready_s, "answer_s": answer_s, "stages": warm_up_stages(data_dir / "logs")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--model-name", default=None, help="the served name (default: the model file's stem)")
    p.add_argument("--data-dir", default=".gaggle-startup")
    p.add_argument("--runs", default="cold,warm")
    p.add_argument("--port", type=int, default=8700)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--up-arg", action="append", default=[], help="an extra `gaggle up` argument (repeatable)")
    p.add_argument("--out", default="BENCHMARKS.md", help="'-': print only")
    args = p.parse_args(argv)
    args.model_name = args.model_name or Path(args.model).stem
    Path(args.data_dir).mkdir(parents=True, exist_ok=True)
    results = {}
    for i, kind in enumerate(args.runs.split(",")):
        results[kind] = one_start(args, kind == "cold", args.port + i)
        print(kind, json.dumps(results[kind]), flush=True)
    stage_names = list(dict.fromkeys(n for r in results.values() for n in r["stages"]))
    rows = [["`gaggle up` → first answered request (s)"] + [_fmt(r["answer_s"]) for r in results.values()],
            ["`gaggle up` → `/ready` (s)"] + [_fmt(r["ready_s"]) for r in results.values()]]
    rows += [[f"worker: {n} (s)"] + [_fmt(r["stages"].get(n)) for r in results.values()] for n in stage_names]
    body = markdown_table(["", *results], rows)
    command = "python -m benchmarks.startup " + " ".join(argv if argv is not None else sys.argv[1:])
    publish("cold-start", command, body, args.out, title="Start-up")
    return 0


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    sys.exit(main())
