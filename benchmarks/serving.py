"""Serving benchmark against the OpenAI-compatible server. Same as `pagedllm bench serve`."""

import argparse
import sys

from pagedllm.bench import serving

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=serving.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serving.add_args(parser)
    sys.exit(serving.main(parser.parse_args()))
