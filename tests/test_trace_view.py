"""`pagedllm trace view`: a real block trace of the bundled model on CPU, drawn through the CLI.

The trace: a burst behind one system prompt (prefix hits: REUSE), one request with n=2 (a fork
and a copy-on-write), then longer requests in a 10-block pool (preemption, EVICT, REACTIVATE).
Greedy and seeded sampling on CPU, so the trace is the same on every run; nothing here depends
on timing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from pagedllm.entrypoints import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = "You are a careful Python assistant. Answer with short code. "


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    """The engine's trace goes to stderr, with the LLM's log lines (which the viewer skips)."""
    from pagedllm import LLM, SamplingParams, default_model_path

    path = str(tmp_path_factory.mktemp("trace") / "trace.jsonl")
    with open(path, "w", encoding="utf-8") as f, contextlib.redirect_stderr(f):
        llm = LLM(
            default_model_path(), device="cpu", block_size=16, num_kv_blocks=10, max_num_seqs=4, trace_blocks=True
        )
        try:
            short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            pair = SamplingParams(n=2, temperature=0.8, seed=0, max_tokens=8, ignore_eos=True)
            burst = [SYSTEM + "def fib(", SYSTEM + "import os\n", SYSTEM + "class Stack:"]
            llm.generate(burst, [short, short, pair], use_tqdm=False)
            long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            later = ["def is_prime(n):", "for i in range(", "import sys\n", SYSTEM + "x ="]
            llm.generate(later, long, use_tqdm=False)
        finally:
            llm.close()
    return path


def events_of(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedllm", *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("pagedllm: error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def rows(picture: str) -> list[int]:
    return [int(b) for b in re.findall(r'<g class="row" data-block="(\d+)">', picture)]


def test_the_trace_has_what_the_picture_should_show(trace):
    kinds = {e["event"] for e in events_of(trace)}
    assert kinds == {"ALLOCATE", "REUSE", "REACTIVATE", "RELEASE", "EVICT"}, kinds


def test_html_has_a_row_per_block_and_a_mark_per_kind(trace, tmp_path):
    out = tmp_path / "trace.html"
    proc = run_cli("trace", "view", trace, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    html = out.read_text(encoding="utf-8")
    assert html.startswith("<!doctype html>") and "<svg" in html
    assert "<script" not in html and "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    events = events_of(trace)
    assert rows(html) == sorted({e["block_id"] for e in events})
    for kind in {e["event"] for e in events} - {"RELEASE"}:  # a release ends a span, it has no mark
        assert f'class="m {kind.lower()}"' in html, kind
    # the n=2 request: its child shares the parent's blocks, and the first write copies the shared last block
    assert 'class="m fork"' in html and 'class="m cow"' in html and 'class="cowline"' in html
    for state in ("held", "shared", "cached", "free"):
        assert f'class="s {state}"' in html, state


def test_svg_output_is_standalone_and_well_formed(trace, tmp_path):
    out = tmp_path / "trace.svg"
    assert cli.main(["trace", "view", trace, "-o", str(out), "--title", "a <test> & more"]) == 0
    svg = out.read_text(encoding="utf-8")
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert len(rows(svg)) == len({e["block_id"] for e in events_of(trace)})
    assert "a &lt;test&gt; &amp; more" in svg
    assert cli.main(["trace", "view", trace, "-o", str(out), "--max-blocks", "3"]) == 0
    assert rows(out.read_text(encoding="utf-8")) == sorted({e["block_id"] for e in events_of(trace)})[:3]


def test_default_output_name_and_a_progress_bar_in_front_of_an_event(trace, tmp_path, capsys):
    """tqdm's bar has no newline of its own: in a captured stderr it sits before the next event."""
    lines = open(trace, encoding="utf-8").read().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith("{"))
    lines[first] = "\rProcessed prompts:   0%|          | 0/3 [00:00<?, ?it/s]" + lines[first]
    lines.insert(0, "INFO 12-04 04:13:02 KV cache: float32, 10 blocks x 16 tokens {'a': 1}\n")
    copy = tmp_path / "stderr.log"
    copy.write_text("".join(lines), encoding="utf-8")
    assert cli.main(["trace", "view", str(copy)]) == 0
    # the inserted log line, and any the captured trace holds itself (a library's warning on a fresh machine)
    n = sum(1 for line in lines if '{"event"' not in line)
    err = capsys.readouterr().err
    assert (f"skipped {n} line that is not" if n == 1 else f"skipped {n} lines that are not") in err, (n, err)
    html = (tmp_path / "stderr.html").read_text(encoding="utf-8")
    assert rows(html) == sorted({e["block_id"] for e in events_of(trace)})
    assert f"{len(events_of(trace))} events" in html


def test_a_malformed_line_is_named(trace, tmp_path):
    lines = open(trace, encoding="utf-8").read().splitlines()
    lines[2] = "{not json"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    proc = run_cli("trace", "view", str(bad), "-o", str(tmp_path / "bad.html"))
    assert proc.returncode == 1
    assert f"{bad}:3: not a JSON object" in one_error_line(proc.stderr)
    assert not (tmp_path / "bad.html").exists()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"event": "ALLOCATE", "block_id": -1, "seq_id": 0, "ref_cnt": 1}', "field 'block_id' must be a non-negative"),
        ('{"event": "SWAP", "block_id": 1, "seq_id": 0, "ref_cnt": 1}', "'event' must be one of ALLOCATE"),
        (
            '{"event": "RELEASE", "seq_id": 0, "ref_cnt": 0}',
            "field 'block_id' must be a non-negative integer, got None",
        ),
    ],
)
def test_a_wrong_event_is_named(tmp_path, capsys, line, message):
    good = '{"event": "ALLOCATE", "block_id": 0, "seq_id": 0, "ref_cnt": 1, "num_free": 3, "group": 0}'
    path = tmp_path / "t.jsonl"
    path.write_text(f"{good}\n{line}\n", encoding="utf-8")
    assert cli.main(["trace", "view", str(path), "-o", str(tmp_path / "t.html")]) == 1
    assert f"{path}:2: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "INFO 12-04 04:13:02 ready in 2.78 s\n"])
def test_an_empty_trace_is_an_error(tmp_path, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text, encoding="utf-8")
    proc = run_cli("trace", "view", str(path))
    assert proc.returncode == 1
    error = one_error_line(proc.stderr)
    assert "holds no block events" in error and "--trace-blocks" in error


def test_a_missing_file_is_an_error(tmp_path, capsys):
    assert cli.main(["trace", "view", str(tmp_path / "nope.jsonl")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_png_without_matplotlib_says_how_to_install_it(trace, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert cli.main(["trace", "view", trace, "-o", str(tmp_path / "t.html"), "--png", str(tmp_path / "t.png")]) == 1
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "t.png").exists()


def test_png(trace, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "trace.png"
    assert cli.main(["trace", "view", trace, "-o", str(tmp_path / "t.html"), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
