"""``gaggle batch ...``: the Batch API from a terminal (any OpenAI-compatible server, standard library HTTP), and
``gaggle batch-worker`` (RQ's worker for batch jobs; api/batch/worker.py).

    gaggle batch submit requests.jsonl [--endpoint /v1/chat/completions] [--wait]
    gaggle batch status|cancel ID     gaggle batch download ID [-o out.jsonl] [--errors]     gaggle batch list
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from api.base_url import add_base_url_arg, server_root

TERMINAL = ("completed", "failed", "expired", "cancelled")


class Client:
    def __init__(self, base_url: str, api_key: str | None):
        self.base = server_root(base_url) + "/v1"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        headers = {**self.headers, **({"Content-Type": "application/json"} if data else {})}
        with self._open(urllib.request.Request(self.base + path, data=data, headers=headers, method=method)) as r:
            return json.load(r)

    def upload(self, path: Path, purpose: str = "batch") -> dict:
        boundary = uuid.uuid4().hex
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n{purpose}\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{path.name}\"\r\n"
                f"Content-Type: application/jsonl\r\n\r\n").encode()
        body = head + path.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
        headers = {**self.headers, "Content-Type": f"multipart/form-data; boundary={boundary}"}
        with self._open(urllib.request.Request(self.base + "/files", data=body, headers=headers, method="POST")) as r:
            return json.load(r)

    def download(self, file_id: str, out) -> int:
        with self._open(urllib.request.Request(f"{self.base}/files/{file_id}/content", headers=self.headers)) as r:
            size = 0
            while chunk := r.read(1 << 20):
                out.write(chunk)
                size += len(chunk)
        return size

    @staticmethod
    def _open(request: urllib.request.Request):
        try:
            return urllib.request.urlopen(request, timeout=600)
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise SystemExit(f"gaggle: {e.code}: {detail}") from None
        except urllib.error.URLError as e:
            raise SystemExit(f"gaggle: cannot reach {request.full_url}: {e.reason}") from None


def progress_line(batch: dict, started: float, tokens_at_start: int) -> str:
    counts = batch.get("request_counts") or {}
    total, done, failed = counts.get("total", 0), counts.get("completed", 0), counts.get("failed", 0)
    elapsed = max(time.monotonic() - started, 1e-9)
    out_tokens = (batch.get("usage") or {}).get("output_tokens", 0)
    rate = (out_tokens - tokens_at_start) / elapsed
    finished = done + failed
    eta = (total - finished) * elapsed / finished if finished else float("nan")
    width = 30
    filled = int(width * finished / total) if total else 0
    eta_text = f"{eta:,.0f} s" if eta == eta else "?"
    return (f"[{'#' * filled}{'.' * (width - filled)}] {finished:,}/{total:,} (failed {failed:,})  "
            f"{rate:,.0f} tok/s  ETA {eta_text}  {batch['status']}")


class Progress:
    """One line redrawn in place on a terminal (the old one erased first: a shorter line leaves nothing behind);
    elsewhere (a log, CI) a line whenever the counts change, at most every ``every_s``."""

    ERASE = "\r\x1b[2K"  # to the line's start, then clear it

    def __init__(self, out=None, every_s: float = 10.0) -> None:
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.every_s = every_s
        self.last_at, self.last_counts = float("-inf"), None

    def show(self, line: str, counts: object, final: bool = False) -> None:
        if self.tty:
            self.out.write(self.ERASE + line + ("\n" if final else ""))
        elif final or (counts != self.last_counts and time.monotonic() - self.last_at >= self.every_s):
            self.out.write(line + "\n")
            self.last_at, self.last_counts = time.monotonic(), counts
        self.out.flush()


def wait(client: Client, batch: dict, interval_s: float = 1.0, progress: Progress | None = None) -> dict:
    progress = progress or Progress()
    started, tokens = time.monotonic(), (batch.get("usage") or {}).get("output_tokens", 0)
    while batch["status"] not in TERMINAL:
        progress.show(progress_line(batch, started, tokens), (batch["status"], batch.get("request_counts")))
        time.sleep(interval_s)
        batch = client.call("GET", f"/batches/{batch['id']}")
    progress.show(progress_line(batch, started, tokens), None, final=True)
    return batch


def cmd_batch(args: argparse.Namespace) -> int:
    client = Client(args.base_url, args.api_key or os.environ.get("OPENAI_API_KEY"))
    if args.action == "submit":
        file = client.upload(Path(args.target))
        batch = client.call("POST", "/batches", {"input_file_id": file["id"], "endpoint": args.endpoint,
                                                 "completion_window": "24h"})
        print(batch["id"])
        if args.wait:
            batch = wait(client, batch)
            print(json.dumps(batch, indent=1))
            return 0 if batch["status"] == "completed" else 1
        return 0
    if args.action == "list":
        print(json.dumps(client.call("GET", "/batches?limit=100"), indent=1))
        return 0
    if not args.target:
        raise SystemExit(f"gaggle: batch {args.action} needs a batch id")
    if args.action == "status":
        print(json.dumps(client.call("GET", f"/batches/{args.target}"), indent=1))
    elif args.action == "cancel":
        print(json.dumps(client.call("POST", f"/batches/{args.target}/cancel"), indent=1))
    elif args.action == "download":
        batch = client.call("GET", f"/batches/{args.target}")
        file_id = batch["error_file_id" if args.errors else "output_file_id"]
        if not file_id:
            raise SystemExit(f"gaggle: batch {args.target} has no {'error' if args.errors else 'output'} file "
                             f"(status {batch['status']})")
        with (open(args.output, "wb") if args.output else sys.stdout.buffer) as out:
            size = client.download(file_id, out)
        print(f"gaggle: {size:,} bytes of {file_id}", file=sys.stderr)
    return 0


def add_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["submit", "status", "cancel", "download", "list"])
    p.add_argument("target", nargs="?", help="submit: a JSONL file; status/cancel/download: a batch id")
    add_base_url_arg(p)
    p.add_argument("--api-key", default=None, help="Bearer key (default: $OPENAI_API_KEY)")
    p.add_argument("--endpoint", default="/v1/chat/completions", choices=["/v1/chat/completions", "/v1/completions"])
    p.add_argument("--wait", action="store_true", help="submit: follow the batch with a progress bar until it ends")
    p.add_argument("-o", "--output", help="download: write here instead of stdout")
    p.add_argument("--errors", action="store_true", help="download: the error file instead of the output file")


def cmd_batch_worker(args: argparse.Namespace) -> int:
    """Settings reach the jobs (RQ forks a process per job) as GAGGLE_* variables, as for the API."""
    from api.server import export_settings
    export_settings(args)  # --redis-url, --files-dir, the limits
    if args.window:
        os.environ["GAGGLE_BATCH_WINDOW"] = str(args.window)
    from api.batch.worker import serve
    return serve(args.redis_url, burst=args.burst, name=args.name)


def add_batch_worker_args(p: argparse.ArgumentParser) -> None:
    from api.server import add_limit_args
    add_limit_args(p)  # the API's: lines are validated and answered as live requests
    p.add_argument("--files-dir", help="the file store the API writes to (default: $GAGGLE_FILES_DIR or .gaggle/files)")
    p.add_argument("--window", type=int, help="a batch's lines in flight at a time (default 4,096)")
    p.add_argument("--burst", action="store_true", help="exit when the batch queue is empty")
    p.add_argument("--name", help="RQ worker name")
