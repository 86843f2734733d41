"""A Timeline (trace_view.py) drawn as one self-contained SVG, and the HTML page around it: inline
SVG, a few lines of CSS, no script, nothing fetched. Hover a span or a mark for its details (an
SVG <title>: block, holders, ref_cnt, event numbers).

Layout, top to bottom: title, legend, the free-block count over the trace (the pool's pressure),
the event axis, then one row (`<g class="row">`) per block: its state spans (`<rect class="s
STATE">`) with the holders' seq ids written on wide spans, and its marks (`class="m KIND"`).
A copy-on-write also draws a line from the source block's row to the copy's.
"""

from __future__ import annotations

from html import escape

from pagedllm.entrypoints.trace_view import MARKS, STATES, Mark, Span, Timeline

ROW = 14  # px per block row
BAR = 10  # px height of a state span
LEFT = 64  # px for the row labels
FREE_H = 36  # px of the free-block strip
MIN_W, MAX_W = 720, 1400  # px of the plot area
COLORS = {
    "held": "#4c78a8",
    "shared": "#1d3f66",
    "cached": "#f2b134",
    "free": "#e3e3e3",
    "unknown": "#f7e3b5",
    "allocate": "#ffffff",
    "reuse": "#e45756",
    "reactivate": "#2ca02c",
    "evict": "#b00020",
    "fork": "#9467bd",
    "cow": "#ff7f0e",
}
LABELS = {
    "held": "held (ref_cnt 1)",
    "shared": "shared (ref_cnt > 1)",
    "cached": "cached-free (findable)",
    "free": "free / evicted",
    "unknown": "free, cached?",
    "allocate": "allocate",
    "reuse": "reuse (prefix hit)",
    "reactivate": "reactivate",
    "evict": "evict",
    "fork": "fork",
    "cow": "copy-on-write",
}
STYLE = (
    "text{font:11px sans-serif;fill:#222}.t{font-size:9px;fill:#fff;pointer-events:none}"
    ".lbl{font-size:10px;fill:#555}"
    + "".join(f".{k}{{fill:{c}}}" for k, c in COLORS.items() if k in STATES)
    + ".s.unknown{stroke:#d9a441;stroke-width:.5;stroke-dasharray:2 2}"
    ".m{stroke:#222;stroke-width:.6}.m.allocate{fill:#fff}.m.evict{fill:none;stroke:#b00020;stroke-width:1.6}"
    + "".join(f".m.{k}{{fill:{COLORS[k]}}}" for k in ("reuse", "reactivate", "fork", "cow"))
    + ".cowline{stroke:#ff7f0e;stroke-width:1;stroke-dasharray:3 2}.free-line{fill:none;stroke:#4c78a8}"
    ".axis{stroke:#999;stroke-width:.5}"
)


def _f(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def _shape(kind: str, x: float, y: float) -> str:
    """The path of a mark centred at (x, y): one shape per kind, so print in grey still reads."""
    r = 3.6
    if kind == "allocate":  # triangle pointing right: a block starts a life
        return f"M{_f(x - r)} {_f(y - r)}L{_f(x + r)} {_f(y)}L{_f(x - r)} {_f(y + r)}Z"
    if kind == "reuse":  # diamond
        return f"M{_f(x)} {_f(y - r)}L{_f(x + r)} {_f(y)}L{_f(x)} {_f(y + r)}L{_f(x - r)} {_f(y)}Z"
    if kind == "reactivate":  # circle, as two arcs
        return f"M{_f(x - r)} {_f(y)}a{r} {r} 0 1 0 {_f(2 * r)} 0a{r} {r} 0 1 0 {_f(-2 * r)} 0Z"
    if kind == "evict":  # a cross
        return f"M{_f(x - r)} {_f(y - r)}L{_f(x + r)} {_f(y + r)}M{_f(x - r)} {_f(y + r)}L{_f(x + r)} {_f(y - r)}"
    if kind == "fork":  # square
        return f"M{_f(x - r)} {_f(y - r)}h{_f(2 * r)}v{_f(2 * r)}h{_f(-2 * r)}Z"
    # cow: triangle pointing down
    return f"M{_f(x - r)} {_f(y - r)}h{_f(2 * r)}L{_f(x)} {_f(y + r)}Z"


def _seqs(seqs: tuple[int, ...]) -> str:
    return ", ".join(f"seq {s}" for s in seqs)


def _span_title(s: Span) -> str:
    what = {
        "held": f"held by {_seqs(s.seqs)}",
        "shared": f"shared by {_seqs(s.seqs)} (ref_cnt {s.ref_cnt})",
        "cached": "free, cached (its hash kept: findable)",
        "free": "free (no hash)",
        "unknown": "free at the end of the trace (cached or not: not in the trace)",
    }[s.state]
    return f"block {s.block_id}: {what}; events {s.start}-{s.end - 1}"


def _mark_title(m: Mark, events: list) -> str:
    e = events[m.index]
    by = f" by seq {m.seq_id}" if m.seq_id is not None else ""
    extra = ""
    if m.kind == "fork":
        extra = f" (fork of seq {m.other}: {e.kind})"
    elif m.kind == "cow":
        extra = f" (copy-on-write: copy of block {m.other})"
    return f"event {m.index} (line {e.line}): {e.kind} block {m.block_id}{by}{extra}, ref_cnt {e.ref_cnt}"


def _ticks(n: int, width: float) -> list[int]:
    """Round event numbers at least 70 px apart."""
    step = 1
    while width * step / max(n, 1) < 70:
        step = step * 5 // 2 if str(step)[0] == "2" else step * 2  # 1, 2, 5, 10, 20, 50, ...
    return list(range(0, n + 1, step))


def _legend(y: float, right: float) -> tuple[list[str], float]:
    """The swatches and mark shapes, wrapped at `right`; returns them and the y below them."""
    out: list[str] = []
    x = float(LEFT)
    for k in (*STATES, "", *MARKS):  # "": the marks start a new line
        w = 24 + 6.2 * len(LABELS.get(k, ""))
        if not k or x + w > right:
            x, y = float(LEFT), y + 16
        if not k:
            continue
        if k in STATES:
            out.append(f'<rect class="s {k}" x="{_f(x)}" y="{_f(y - 9)}" width="14" height="{BAR}"/>')
        else:
            out.append(f'<path class="m {k}" d="{_shape(k, x + 7, y - 4)}"/>')
        out.append(f'<text x="{_f(x + 18)}" y="{_f(y)}">{LABELS[k]}</text>')
        x += w
    return out, y


def render_svg(tl: Timeline, title: str | None = None) -> str:
    n = max(tl.num_events, 1)
    width = float(min(MAX_W, max(MIN_W, 10 * n)))
    px = width / n  # px per event

    def xat(i: float) -> float:
        return LEFT + i * px

    title = title or f"KV block trace: {tl.source}"
    shown = (
        f"{len(tl.blocks)} of {tl.num_blocks_in_trace} blocks drawn"
        if len(tl.blocks) < tl.num_blocks_in_trace
        else f"{len(tl.blocks)} blocks"
    )
    pool = f", pool of {tl.pool_size}" if tl.pool_size is not None else ""
    sub = f"{tl.num_events} events, {shown}{pool}, {len(tl.seqs)} sequences"
    out: list[str] = []
    y = 16.0
    out.append(f'<text x="{LEFT}" y="{_f(y)}" style="font-weight:bold">{escape(title)}</text>')
    out.append(f'<text class="lbl" x="{LEFT}" y="{_f(y + 14)}">{escape(sub)}</text>')
    legend, y = _legend(y + 36, LEFT + width)
    out.extend(legend)
    y += 14
    free = [(e.index, e.num_free) for e in tl.events if e.num_free is not None]
    if free:
        top = max(max(v for _, v in free), 1)
        # a step line: the count after event i holds until event i + 1
        pts = " ".join(
            f"{_f(xat(i))},{_f(yv)} {_f(xat(i + 1))},{_f(yv)}" for i, v in free for yv in [y + FREE_H * (1 - v / top)]
        )
        out.append(f'<text class="lbl" x="{LEFT - 4}" y="{_f(y + 8)}" text-anchor="end">{top}</text>')
        out.append(f'<text class="lbl" x="{LEFT - 4}" y="{_f(y + FREE_H)}" text-anchor="end">0</text>')
        out.append(f'<text class="lbl" x="{LEFT - 18}" y="{_f(y + FREE_H / 2 + 4)}" text-anchor="end">free</text>')
        out.append(
            f'<line class="axis" x1="{LEFT}" y1="{_f(y + FREE_H)}" x2="{_f(LEFT + width)}" y2="{_f(y + FREE_H)}"/>'
        )
        out.append(f'<polyline class="free-line" points="{pts}"/>')
        y += FREE_H + 8
    for t in _ticks(tl.num_events, width):
        out.append(f'<line class="axis" x1="{_f(xat(t))}" y1="{_f(y + 4)}" x2="{_f(xat(t))}" y2="{_f(y + 9)}"/>')
        out.append(f'<text class="lbl" x="{_f(xat(t))}" y="{_f(y)}" text-anchor="middle">{t}</text>')
    y += 10
    row_y = {b: y + k * ROW for k, b in enumerate(tl.blocks)}
    spans: dict[int, list[Span]] = {b: [] for b in tl.blocks}
    for s in tl.spans:
        spans[s.block_id].append(s)
    marks: dict[int, list[Mark]] = {b: [] for b in tl.blocks}
    for m in tl.marks:
        marks[m.block_id].append(m)
    for b in tl.blocks:
        ry = row_y[b]
        out.append(f'<g class="row" data-block="{b}">')
        out.append(f'<text class="lbl" x="{LEFT - 7}" y="{_f(ry + BAR)}" text-anchor="end">block {b}</text>')
        for s in spans[b]:
            x0, w = xat(s.start), (s.end - s.start) * px
            label = ",".join(str(q) for q in s.seqs)
            out.append(
                f'<rect class="s {s.state}" x="{_f(x0)}" y="{_f(ry + 1)}" width="{_f(w)}" height="{BAR}">'
                f"<title>{escape(_span_title(s))}</title></rect>"
            )
            if label and w >= 6 * len(label) + 8:  # the holders' seq ids, where they fit
                out.append(f'<text class="t" x="{_f(x0 + 5)}" y="{_f(ry + BAR - 1)}">{label}</text>')
        for m in marks[b]:
            out.append(
                f'<path class="m {m.kind}" d="{_shape(m.kind, xat(m.index), ry + 1 + BAR / 2)}">'
                f"<title>{escape(_mark_title(m, tl.events))}</title></path>"
            )
        out.append("</g>")
    for m in tl.marks:  # copy-on-write: source row -> copy row
        if m.kind == "cow" and m.other in row_y:
            x = _f(xat(m.index))
            y1, y2 = row_y[m.other] + 1 + BAR / 2, row_y[m.block_id] + 1 + BAR / 2
            out.append(f'<line class="cowline" x1="{x}" y1="{_f(y1)}" x2="{x}" y2="{_f(y2)}"/>')
    height = y + len(tl.blocks) * ROW + 16
    out.append(
        f'<text class="lbl" x="{_f(LEFT + width / 2)}" y="{_f(height - 4)}" text-anchor="middle">'
        "event number (trace order); numbers on a span: the seq ids holding the block; "
        "hover a span or a mark for details</text>"
    )
    total_w = LEFT + width + 12
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_f(total_w)}" height="{_f(height)}" '
        f'viewBox="0 0 {_f(total_w)} {_f(height)}" role="img"><title>{escape(title)}</title>'
        f'<style>{STYLE}</style><rect width="100%" height="100%" fill="#fff"/>\n' + "\n".join(out) + "\n</svg>\n"
    )


def render_html(tl: Timeline, title: str | None = None) -> str:
    title = title or f"KV block trace: {tl.source}"
    counts = tl.counts()
    rows = "".join(f"<tr><td>{escape(k)}</td><td>{v}</td></tr>" for k, v in sorted(counts.items()))
    skipped = (
        f" Lines of the file that are not events (log lines, progress bars) were skipped: {tl.skipped_lines}."
        if tl.skipped_lines
        else ""
    )
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>"
        "body{font:14px sans-serif;margin:1.5em;color:#222}.plot{overflow-x:auto;border:1px solid #ddd}"
        "table{border-collapse:collapse;margin:1em 0}td{border:1px solid #ddd;padding:2px 8px}"
        "</style></head><body>\n"
        f"<h1>{escape(title)}</h1>\n"
        f"<p>One row per physical KV block, events in trace order from left to right. Spans: the block's "
        f"state; marks: the events that change it (FORK and COW are recognised from their event patterns). "
        f"Hover for the holders' sequence ids.{escape(skipped)}</p>\n"
        f'<div class="plot">{render_svg(tl, title)}</div>\n'
        f"<table><tr><td><b>event</b></td><td><b>count</b></td></tr>{rows}</table>\n"
        "</body></html>\n"
    )
