"""`pagedllm bench sharing`: the command over the two workloads, parallel sampling (sharing.py) and
beam search (sharing_beam.py), which import each other's pieces in one direction only
(sharing_beam -> sharing); this module, above both, holds the flags and the report.
"""

from __future__ import annotations

import argparse
import json
import sys

from pagedllm.bench.sharing import BLOCK_SIZE, DATASETS, MAX_LEN, environment, measure
from pagedllm.bench.sharing_beam import measure_beam


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=["parallel", "beam"],
        default="parallel",
        help="parallel: n samples per request vs n separate requests; beam: beam search of width n vs one "
        "contiguous copy per beam",
    )
    p.add_argument(
        "--datasets", nargs="+", choices=sorted(DATASETS), default=["alpaca", "sharegpt"], help="length distributions"
    )
    p.add_argument(
        "--n", nargs="+", type=int, default=[2, 4, 6], help="samples per request (parallel) or beam width (beam)"
    )
    p.add_argument("--num-requests", type=int, default=200, help="requests per run")
    p.add_argument(
        "--concurrency",
        type=float,
        default=32.0,
        help="requests alive on average: sets the Poisson arrival rate per step",
    )
    p.add_argument(
        "--distribution",
        choices=["lognormal", "exponential"],
        default="lognormal",
        help="lengths' distribution, with the dataset's mean (clipped to [1, 1024])",
    )
    p.add_argument(
        "--sample-lengths",
        choices=["same", "independent"],
        default="same",
        help="same: a request's samples all run to its drawn output length (vLLM's benchmarks: ignore_eos, "
        "max_tokens); independent: each sample draws its own",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the lengths, prompts and arrivals")
    p.add_argument("--output-json", help="write the rows, with commit, date, machine and parameters, to this file")


def main(args) -> int:
    if any(k < 1 or k > 64 for k in args.n):
        raise ValueError("--n must be between 1 and 64")
    if args.num_requests < 1 or args.concurrency <= 0:
        raise ValueError("--num-requests and --concurrency must be positive")
    beam = args.mode == "beam"
    if beam and args.sample_lengths != "same":
        raise ValueError(
            "--sample-lengths independent is for --mode parallel (a request's beams all run to its length)"
        )
    if beam:
        rows = [measure_beam(d, n, args) for d in args.datasets for n in args.n]
        key, paper = "beam_width", "paper_saving_pct_w2_to_w6"
    else:
        rows = [measure(d, n, args) for d in args.datasets for n in args.n]
        key, paper = "n", "paper_saving_pct_n2_to_n6"
    k = "W" if beam else "n"
    head = f"{'dataset':<9} {k:>2} {'avg blocks w/o -> with':>24} {'saving':>7} {'peak w/o -> with':>18} {'saving':>7}  paper"
    print(head)
    for r in rows:
        avg = f"{r['time_avg_blocks_without']:.0f} -> {r['time_avg_blocks_with']:.0f}"
        peak = f"{r['peak_blocks_without']} -> {r['peak_blocks_with']}"
        print(
            f"{r['dataset']:<9} {r[key]:>2} {avg:>24} {r['time_avg_saving_pct']:>6.1f}% {peak:>18} "
            f"{r['peak_saving_pct']:>6.1f}%  {r[paper]}% ({k}=2-6)"
        )
    if args.output_json:
        names = ["mode", "datasets", "n", "num_requests", "concurrency", "distribution", "sample_lengths", "seed"]
        params = {name: getattr(args, name) for name in names}
        doc = {
            "benchmark": "sharing",
            **environment(),
            "parameters": {**params, "block_size": BLOCK_SIZE, "max_len": MAX_LEN, "lengths": DATASETS},
            "rows": rows,
        }
        with open(args.output_json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"written to {args.output_json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    sys.exit(main(parser.parse_args()))
