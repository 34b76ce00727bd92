"""Saved ``gaggle bench`` results, served and engine-only, as the served area's table: a row per load.

    gaggle bench ... --save-result s256.json
    gaggle bench --engine-only ... --save-result s256-engine-only.json
    python -m benchmarks.served s256.json s256-engine-only.json [--note "Service: ..."] [--out BENCHMARKS.md]

Results of the same load (same prompts, lengths, concurrency, rate, temperature) share a row: the served run's
output tok/s over the engine-only run's is what the service around the engine costs (``gaggle bench --compare``
prints every metric's ratio for one pair).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from benchmarks.report import command_line, markdown_table, publish

HEADER = ["load", "served tok/s", "engine-only tok/s", "served / engine-only", "served TTFT p50 / p99 ms",
          "engine-only TTFT p50 / p99 ms", "served ITL p50 ms"]
LOAD_KEYS = ("num_prompts", "input_len", "output_len", "max_concurrency", "request_rate", "temperature")


def load_label(config: dict) -> str:
    """A load in one cell: how requests arrive, and the flags that made it."""
    rate, concurrency = config.get("request_rate"), config.get("max_concurrency")
    closed = rate in ("inf", None)
    if closed:
        what = f"{concurrency:,} streams" if concurrency else f"{config.get('num_prompts'):,} requests at once"
    else:
        what = f"Poisson {rate:g} requests/s" + (f", ≤ {concurrency:,} in flight" if concurrency else "")
    flags = f"--num-prompts {config.get('num_prompts')}" + (f" --max-concurrency {concurrency}" if concurrency else "")
    flags += "" if closed else f" --request-rate {rate:g}"
    return f"{what} (`{flags}`)"


def _ms(result: dict | None, key: str, both: bool = True) -> str:
    """p50 / p99 of a latency (p50 alone, to 0.01 ms: an ITL)."""
    if result is None or result["metrics"].get(f"median_{key}_ms") is None:
        return "–"
    m = result["metrics"]
    return f"{m[f'median_{key}_ms']:,.1f} / {m[f'p99_{key}_ms']:,.1f}" if both else f"{m[f'median_{key}_ms']:,.2f}"


def rows(results: list[dict]) -> list[list]:
    """One row per load, in the order the loads first appear."""
    loads: dict[tuple, dict[str, dict]] = {}
    for r in results:
        loads.setdefault(tuple(r["config"].get(k) for k in LOAD_KEYS), {})[r.get("mode", "served")] = r
    out = []
    for runs in loads.values():
        served, engine = runs.get("served"), runs.get("engine-only")
        rate = lambda r: r["metrics"]["output_throughput"] if r else None  # noqa: E731
        ratio = f"{rate(served) / rate(engine):.3f}" if served and engine and rate(engine) else "–"
        out.append([load_label((served or engine)["config"]),
                    f"{rate(served):,.0f}" if served else "–", f"{rate(engine):,.0f}" if engine else "–", ratio,
                    _ms(served, "ttft"), _ms(engine, "ttft"), _ms(served, "itl", both=False)])
    return out


def caption(results: list[dict]) -> str:
    """What every row shares: prompt and output lengths, temperature, ignore_eos."""
    c = results[0]["config"]
    temperature = "" if c.get("temperature") is None else f", T={c['temperature']:g}"
    return (f"Load: {c.get('input_len')}-token prompts, {c.get('output_len')} output tokens{temperature}"
            + (", `--ignore-eos`" if c.get("ignore_eos") else "") + ".")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="`gaggle bench --save-result` files")
    ap.add_argument("--note", default="", help="a paragraph above the table (e.g. the service's command line)")
    ap.add_argument("--command", help="what made the results, for the record (default: this command)")
    ap.add_argument("--out", default="BENCHMARKS.md", help="'-': print only")
    ap.add_argument("--area", default="served", help="the BENCHMARKS.md block to replace")
    args = ap.parse_args(argv)
    results = [orjson.loads(Path(p).read_bytes()) for p in args.results]
    body = " ".join(filter(None, [args.note.strip(), caption(results)])) + "\n\n" + markdown_table(HEADER, rows(results))
    publish(args.area, args.command or command_line("benchmarks.served", argv), body, args.out,
            title="Served: `gaggle up` + `gaggle bench` against engine-only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
