"""Shares of a py-spy profile (`--format raw`: one collapsed stack per line, then its sample count).

Prints the samples in total, the share where the process waited (the innermost frame is a wait:
select/poll/recv/sleep/synchronize...), the top functions by self samples, and by inclusive
samples the pagedllm functions (a function counts once per stack). Used on the profiles of
scripts/serve_profile_gpu.sh:

    python benchmarks/profile_shares.py gpu_out/pagedllm-core.raw [--top 25] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

WAITS = ("select", "poll", "epoll", "recv", "_recv", "sleep", "synchronize", "wait", "acquire", "accept", "read")


def parse(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    for line in open(path):
        line = line.rstrip("\n")
        if not line:
            continue
        frames, _, count = line.rpartition(" ")
        stacks.append((frames.split(";"), int(count)))
    return stacks


def name(frame: str) -> str:
    """'func (path/file.py:12)' -> 'func (path/file.py)': lines of one function count together."""
    func, _, where = frame.partition(" (")
    return f"{func} ({where.rsplit(':', 1)[0]})" if where else func


def shares(stacks: list[tuple[list[str], int]], top: int) -> dict:
    total = sum(c for _, c in stacks)
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    waiting = 0
    for frames, c in stacks:
        leaf = name(frames[-1])
        self_c[leaf] += c
        if leaf.split(" (")[0].split(".")[-1].lstrip("_") in WAITS or leaf.split(" (")[0] in WAITS:
            waiting += c
        for f in {name(f) for f in frames}:
            incl[f] += c
    pct = lambda c: round(100 * c / max(1, total), 1)  # noqa: E731
    return {
        "samples": total,
        "waiting_pct": pct(waiting),
        "self_top": [(f, pct(c)) for f, c in self_c.most_common(top)],
        "pagedllm_inclusive_top": [(f, pct(c)) for f, c in incl.most_common() if "pagedllm/" in f][:top],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", nargs="+")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", help="write every file's shares to this JSON file")
    args = p.parse_args()
    out = {}
    for path in args.raw:
        s = shares(parse(path), args.top)
        out[path] = s
        print(f"== {path}: {s['samples']} samples, waiting {s['waiting_pct']}%")
        print("  self:")
        for f, v in s["self_top"]:
            print(f"    {v:5.1f}%  {f}")
        print("  inclusive (pagedllm):")
        for f, v in s["pagedllm_inclusive_top"]:
            print(f"    {v:5.1f}%  {f}")
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
