"""`python -m pagedllm ...` is the `pagedllm` command."""

import sys

from pagedllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
