"""The A/B table of `ab` logs (lib.sh): graph-replay ms at batch 1 / batch 1,024, "round 1, round 2" each.
python .gpu/abtable.py DIR TAG... (a TAG as lib.sh's tag_of writes it: "defaults", "FAST_EXP+CHEAP_SKIP", ...)"""
import pathlib
import sys


def replay_ms(log: pathlib.Path) -> dict[tuple[str, str], tuple[str, str]]:
    """(mix, logits) -> (batch 1, batch 1,024) graph-replay ms of one switch_ab.py --graphed log."""
    rows = {}
    for line in log.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[1].startswith("σ"):
            rows[(cells[0], cells[1])] = (cells[3], cells[5])
    return rows


def main(folder: pathlib.Path, tags: list[str]) -> None:
    rounds = {t: [replay_ms(folder / f"ab-{t}-{r}.log") for r in (1, 2)] for t in tags}
    print("| mix | logits | " + " | ".join(t.replace("+", " + ") for t in tags) + " |")
    print("|---|---|" + "---|" * len(tags))
    for key in rounds[tags[0]][0]:
        cells = [f"{a[key][0]}, {b[key][0]} / {a[key][1]}, {b[key][1]}" for a, b in (rounds[t] for t in tags)]
        print(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), sys.argv[2:])
