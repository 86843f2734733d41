"""Offline throughput benchmark (nano-vllm's workload). Same as `pagedllm bench throughput`."""

import argparse
import sys

from pagedllm.bench import throughput

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=throughput.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    throughput.add_args(parser)
    args = parser.parse_args()
    if args.compare_hf and args.load_format == "dummy":  # HF would look for the weights pagedllm made up
        parser.error(
            "--compare-hf needs the weights on disk (HF transformers loads the checkpoint): write one with "
            "tools/make_random_model.py (e.g. fewer layers via --layers) instead of --load-format dummy"
        )
    sys.exit(throughput.main(args))
