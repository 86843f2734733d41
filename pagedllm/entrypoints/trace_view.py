"""The block trace (engine/trace.py) read back as a timeline: one row per physical block, a span
per stretch of one state, a mark per event worth seeing. `pagedllm trace view` draws it
(trace_svg.py: SVG and HTML; cli_trace.py: the command and --png).

States of a block between two of its events:
  held     ref_cnt 1: one sequence's block table holds it
  shared   ref_cnt > 1: several do (a prefix hit on a live block, a fork)
  cached   free, with its hash: a later request can find it (REACTIVATE) until it is EVICTed
  free     free, no hash: it was never registered, or it was evicted
  unknown  free at the end of the trace, no hit seen since its ALLOCATE: the trace does not say
           whether it was registered (registration is not an event)
The event that ends a free stretch tells which it was: REACTIVATE or EVICT prove a hash, an
ALLOCATE without EVICT proves none; at the end of the trace, a prefix hit since the block's
ALLOCATE proves one (a block is found by its hash only once it is registered; a fork's REUSE
is no lookup and proves nothing).

The trace has no FORK or copy-on-write events; both are recognised by their shapes
(kv_cache_manager.py, single_type_kv_cache_manager.py):
  fork           a run of REUSE events by a sequence that held nothing, covering exactly the blocks
                 another sequence holds, and not followed by that sequence's ALLOCATE (a prefix hit
                 always is: the last prompt token is never served from the cache)
  copy-on-write  an ALLOCATE of block d by sequence s followed at once by s's RELEASE of another
                 block that stays held (`_copy_last_block`: d is the private copy of the shared one)
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

KINDS = ("ALLOCATE", "REUSE", "REACTIVATE", "RELEASE", "EVICT")  # what engine/trace.py writes
# read and skipped (counted as skipped lines): the host tier's copies, and a speculative rollback
# (the RELEASE that follows it draws the block's change)
SKIPPED_KINDS = ("OFFLOAD", "LOAD", "HOST_EVICT", "ROLLBACK")
STATES = ("held", "shared", "cached", "free", "unknown")
MARKS = ("allocate", "reuse", "reactivate", "evict", "fork", "cow")  # cow: copy-on-write (the copy)


class TraceError(ValueError):
    """A trace that cannot be drawn; the message names the file and line."""


@dataclass(frozen=True)
class Event:
    index: int  # position among the trace's events: the x axis
    line: int  # line number in the file
    kind: str
    block_id: int
    seq_id: int | None
    ref_cnt: int  # after the event
    num_free: int | None
    group: int


@dataclass(frozen=True)
class Span:
    block_id: int
    start: int  # event index where the state begins
    end: int  # event index where it ends (exclusive)
    state: str
    ref_cnt: int
    seqs: tuple[int, ...]  # the holders' seq ids


@dataclass(frozen=True)
class Mark:
    index: int
    block_id: int
    kind: str  # one of MARKS
    seq_id: int | None
    other: int | None = None  # fork: the parent seq; cow: the source block


@dataclass
class Timeline:
    source: str
    events: list[Event]
    spans: list[Span] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # the rows drawn, in id order
    num_blocks_in_trace: int = 0
    pool_size: int | None = None  # held + num_free, where the trace says num_free
    skipped_lines: int = 0

    @property
    def num_events(self) -> int:
        return len(self.events)

    @property
    def seqs(self) -> set[int]:
        return {e.seq_id for e in self.events if e.seq_id is not None}

    def counts(self) -> Counter[str]:
        """Events by trace kind, plus the inferred fork and cow marks."""
        c: Counter[str] = Counter(e.kind for e in self.events)
        c.update(m.kind.upper() for m in self.marks if m.kind in ("fork", "cow"))
        return c


# ---- reading ------------------------------------------------------------------------------
def _int(obj: dict, key: str, lineno: int, source: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{source}:{lineno}: field {key!r} must be a non-negative integer, got {value!r}")
    return value


def parse_trace(lines: Iterable[str], source: str) -> tuple[list[Event], int]:
    """The events of a JSON-lines trace, and how many lines were skipped. A line that starts
    with `{` must be one valid event. Other lines are skipped: the engine writes the trace to
    stderr, where log lines and progress bars go too (a bar without its newline can sit in front
    of an event on the same line; the event is taken from its `{"event"`)."""
    events: list[Event] = []
    skipped = 0
    for lineno, raw in enumerate(lines, 1):
        text = raw.strip()
        start = 0 if text.startswith("{") else text.find('{"event"')
        if start < 0:
            skipped += bool(text)
            continue
        try:
            obj = json.loads(text[start:])
        except json.JSONDecodeError as e:
            raise TraceError(f"{source}:{lineno}: not a JSON object ({e.msg}): {text[:60]!r}") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{source}:{lineno}: not a JSON object: {text[:60]!r}")
        kind = obj.get("event")
        if kind in SKIPPED_KINDS:
            skipped += 1
            continue
        if kind not in KINDS:
            raise TraceError(f"{source}:{lineno}: 'event' must be one of {', '.join(KINDS)}, got {kind!r}")
        seq = obj.get("seq_id")
        if seq is not None:
            seq = _int(obj, "seq_id", lineno, source)
        events.append(
            Event(
                index=len(events),
                line=lineno,
                kind=kind,
                block_id=_int(obj, "block_id", lineno, source),
                seq_id=seq,
                ref_cnt=_int(obj, "ref_cnt", lineno, source),
                num_free=None if obj.get("num_free") is None else _int(obj, "num_free", lineno, source),
                group=0 if obj.get("group") is None else _int(obj, "group", lineno, source),
            )
        )
    return events, skipped


def load_trace(path: str, max_blocks: int | None = None) -> Timeline:
    """Read and analyse a trace file ("-": stdin); TraceError names what is wrong."""
    source = "<stdin>" if path == "-" else path
    try:
        if path == "-":
            events, skipped = parse_trace(sys.stdin, source)
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                events, skipped = parse_trace(f, source)
    except OSError as e:
        raise TraceError(f"cannot read {source}: {e.strerror or e}") from None
    if not events:
        what = f"{skipped} lines, none of them a block event" if skipped else "the file is empty"
        raise TraceError(
            f"{source} holds no block events ({what}); write a trace with --trace-blocks "
            "(the trace goes to stderr) or LLM(..., trace_blocks=True)"
        )
    tl = build_timeline(events, source, max_blocks)
    tl.skipped_lines = skipped
    return tl


# ---- analysis -----------------------------------------------------------------------------
def _forks(events: list[Event]) -> dict[int, int]:
    """Event index of each REUSE that is part of a fork -> the parent seq id (module docstring)."""
    held: dict[int, list[int]] = {}  # seq -> blocks it holds
    out: dict[int, int] = {}
    i, n = 0, len(events)
    while i < n:
        e = events[i]
        if e.kind == "REUSE" and e.seq_id is not None and not held.get(e.seq_id):
            j = i
            while j + 1 < n and events[j + 1].kind == "REUSE" and events[j + 1].seq_id == e.seq_id:
                j += 1
            nxt = events[j + 1] if j + 1 < n else None
            prefix_hit = nxt is not None and nxt.seq_id == e.seq_id and nxt.kind in ("ALLOCATE", "EVICT", "REACTIVATE")
            run = {events[k].block_id for k in range(i, j + 1)}
            parent = next((s for s, bl in held.items() if s != e.seq_id and set(bl) == run), None)
            if not prefix_hit and parent is not None:
                out.update(dict.fromkeys(range(i, j + 1), parent))
        if e.seq_id is not None:
            if e.kind == "RELEASE":
                bl = held.get(e.seq_id, [])
                if e.block_id in bl:
                    bl.remove(e.block_id)
            elif e.kind != "EVICT":
                held.setdefault(e.seq_id, []).append(e.block_id)
        i += 1
    return out


def _copy_on_writes(events: list[Event]) -> dict[int, int]:
    """Event index of each ALLOCATE that makes a copy-on-write copy -> the source block."""
    out: dict[int, int] = {}
    for a, r in zip(events, events[1:], strict=False):
        if (
            a.kind == "ALLOCATE"
            and r.kind == "RELEASE"
            and a.seq_id is not None
            and r.seq_id == a.seq_id
            and r.block_id != a.block_id
            and r.ref_cnt > 0
        ):
            out[a.index] = r.block_id
    return out


class _BlockState:
    def __init__(self) -> None:
        self.start: int | None = None  # the open span's start; None: never seen
        self.state = "unknown"
        self.ref_cnt = 0
        self.seqs: list[int] = []
        self.hit = False  # found by its hash since its last ALLOCATE: it is registered


def build_timeline(events: list[Event], source: str, max_blocks: int | None = None) -> Timeline:
    blocks_all = sorted({e.block_id for e in events})
    shown = blocks_all if max_blocks is None else blocks_all[:max_blocks]
    keep = set(shown)
    forks, cows = _forks(events), _copy_on_writes(events)
    tl = Timeline(source, events, blocks=shown, num_blocks_in_trace=len(blocks_all))
    states: dict[int, _BlockState] = {}
    held_now = 0
    for e in events:
        b = states.setdefault(e.block_id, _BlockState())
        if b.start is not None and b.start < e.index:
            state = b.state
            if state == "unknown":  # the event that ends a free stretch tells what it was
                state = "cached" if e.kind in ("REACTIVATE", "EVICT") else "free"
            tl.spans.append(Span(e.block_id, b.start, e.index, state, b.ref_cnt, tuple(b.seqs)))
        was_held = b.ref_cnt > 0
        b.ref_cnt = e.ref_cnt
        if e.kind == "ALLOCATE":
            b.seqs, b.hit = [], False
        elif e.kind == "REACTIVATE" or (e.kind == "REUSE" and e.index not in forks):  # a fork is no lookup
            b.hit = True
        if e.seq_id is not None:
            if e.kind == "RELEASE":
                if e.seq_id in b.seqs:
                    b.seqs.remove(e.seq_id)
            elif e.kind != "EVICT":
                b.seqs.append(e.seq_id)
        if e.kind == "EVICT":
            b.state, b.seqs = "free", []  # its hash is gone; the ALLOCATE follows at once
        elif b.ref_cnt == 0:
            b.state, b.seqs = "unknown", []
        else:
            b.state = "shared" if b.ref_cnt > 1 else "held"
        b.start = e.index
        held_now += (b.ref_cnt > 0) - was_held
        if e.num_free is not None:
            tl.pool_size = max(tl.pool_size or 0, held_now + e.num_free)
        mark = _mark_of(e, forks, cows)
        if mark is not None and e.block_id in keep:
            tl.marks.append(mark)
    end = len(events)
    for block_id, b in states.items():
        if b.start is not None and b.start < end:
            state = "cached" if b.state == "unknown" and b.hit else b.state
            tl.spans.append(Span(block_id, b.start, end, state, b.ref_cnt, tuple(b.seqs)))
    tl.spans = [s for s in tl.spans if s.block_id in keep]
    tl.spans.sort(key=lambda s: (s.block_id, s.start))
    return tl


def _mark_of(e: Event, forks: dict[int, int], cows: dict[int, int]) -> Mark | None:
    if e.index in forks:
        return Mark(e.index, e.block_id, "fork", e.seq_id, forks[e.index])
    if e.index in cows:
        return Mark(e.index, e.block_id, "cow", e.seq_id, cows[e.index])
    if e.kind == "RELEASE":
        return None  # a release shows as the end of a holder on the span
    return Mark(e.index, e.block_id, e.kind.lower(), e.seq_id)
