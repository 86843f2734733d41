"""Offline throughput benchmark (nano-vllm's workload). Same as `pagedllm bench throughput`."""

import argparse
import sys

from pagedllm.bench import throughput

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=throughput.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    throughput.add_args(parser)
    sys.exit(throughput.main(parser.parse_args()))
