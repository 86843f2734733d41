"""`pagedllm trace view`: draw a KV block trace (`--trace-blocks`, `LLM(trace_blocks=True)`) as
a timeline of the blocks' lives: an HTML page (inline SVG, no script, nothing fetched), a
standalone SVG (`-o NAME.svg`) and, where matplotlib is installed, a PNG (`--png`).
trace_view.py reads and analyses the trace; trace_svg.py draws it.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from pagedllm.entrypoints.args import RUNTIME_ERROR, USAGE_ERROR, CLIError
from pagedllm.entrypoints.trace_view import MARKS, STATES, Timeline, TraceError, load_trace

logger = logging.getLogger("pagedllm")

EPILOG = """\
examples:
  pagedllm generate --trace-blocks --num-kv-blocks 16 'def fibonacci(' 2> trace.jsonl
  pagedllm trace view trace.jsonl -o trace.html
  pagedllm trace view trace.jsonl -o trace.svg --max-blocks 32 --png trace.png

Lines that do not start with '{' (the log lines and progress bars that share stderr with the
trace) are skipped; a line that does must be one trace event."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Draw a KV block trace as a timeline: one row per physical block, coloured by state\n"
        "(held, shared, cached-free, free), with marks for allocate, reuse, reactivate, evict,\n"
        "fork and copy-on-write."
    )
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("trace", metavar="TRACE", help="a JSON-lines block trace, or '-' for stdin")
    p.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="the picture: NAME.svg writes a standalone SVG, any other name an HTML page (default: TRACE.html)",
    )
    p.add_argument("--png", metavar="PNG", help="also write a PNG (needs matplotlib)")
    p.add_argument("--max-blocks", type=_positive, metavar="N", help="draw only the N lowest block ids (default: all)")
    p.add_argument("--title", help="the picture's title (default: the trace's file name)")


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CLIError(
            "--png needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'pagedllm[docs]'); the HTML and SVG outputs need nothing",
            RUNTIME_ERROR,
        ) from None
    return plt


def run(args: argparse.Namespace) -> int:
    output = args.output
    if output is None:
        if args.trace == "-":
            raise CLIError("reading the trace from stdin needs -o OUT", USAGE_ERROR)
        output = os.path.splitext(args.trace)[0] + ".html"
    plt = _matplotlib() if args.png else None  # before any work: a missing package fails at once
    try:
        tl = load_trace(args.trace, args.max_blocks)
    except TraceError as e:
        raise CLIError(str(e), RUNTIME_ERROR) from None
    from pagedllm.entrypoints.trace_svg import render_html, render_svg

    text = render_svg(tl, args.title) if output.lower().endswith(".svg") else render_html(tl, args.title)
    _write(output, text)
    if plt is not None:
        try:
            write_png(tl, args.png, plt, args.title)
        except OSError as e:
            raise CLIError(f"cannot write {args.png}: {e.strerror or e}", RUNTIME_ERROR) from None
    if tl.skipped_lines:
        n = tl.skipped_lines
        logger.info(
            "skipped %s (log lines, progress bars)",
            "1 line that is not a trace event" if n == 1 else f"{n} lines that are not trace events",
        )
    done = ", ".join(x for x in (output, args.png) if x)
    logger.info("wrote %s: %d events, %d blocks, %d sequences", done, tl.num_events, len(tl.blocks), len(tl.seqs))
    return 0


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e.strerror or e}", RUNTIME_ERROR) from None


def write_png(tl: Timeline, path: str, plt: Any, title: str | None = None) -> None:
    """The same picture through matplotlib: state bars per block row, marks as scatter points."""
    from pagedllm.entrypoints.trace_svg import COLORS, LABELS

    rows = {b: k for k, b in enumerate(tl.blocks)}
    height = 1.6 + 0.22 * len(rows)
    fig, ax = plt.subplots(figsize=(min(16.0, max(7.0, tl.num_events / 25)), height))
    for state in STATES:
        for b, k in rows.items():
            bars = [(s.start, s.end - s.start) for s in tl.spans if s.block_id == b and s.state == state]
            if bars:
                ax.broken_barh(bars, (k - 0.35, 0.7), facecolors=COLORS[state])
        ax.bar(0, 0, color=COLORS[state], label=LABELS[state])  # legend entry
    markers = {"allocate": ">", "reuse": "D", "reactivate": "o", "evict": "x", "fork": "s", "cow": "v"}
    for kind in MARKS:
        pts = [(m.index, rows[m.block_id]) for m in tl.marks if m.kind == kind]
        if pts:
            xs, ys = zip(*pts, strict=True)
            edge = {} if kind == "evict" else {"edgecolors": "#222"}  # x is a line marker: no edge
            ax.scatter(xs, ys, marker=markers[kind], s=18, c=COLORS[kind], label=LABELS[kind], zorder=3, **edge)
    ax.set_yticks(range(len(rows)), [f"block {b}" for b in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, max(tl.num_events, 1))
    ax.set_xlabel("event number (trace order)")
    ax.set_title(title or f"KV block trace: {tl.source}", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
