"""Every ```python block of README.md and docs/*.md runs as written, and every `>>>`
session in them raises the very error it shows.

A python block that is not meant to run here (it needs a GPU, or it is a signature
summary with placeholders) says so on the line above it: `<!-- not run: the reason -->`.
Nothing else is skipped. A block whose `import cupy as cp` line promises "or numpy" (the
README's first example) runs with NumPy standing in for CuPy, as that promise says it may,
and with CuPy too where there is a GPU.
"""
import linecache
import pathlib
import re
import sys

import numpy as np
import pytest

from conftest import HAS_GPU

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S.*?)\s*-->$")
NUMPY_FOR_CUPY = re.compile(r"^import cupy as cp\s+#.*\bor numpy\b", re.M)


def fenced_blocks(page):
    """(info string, line of the opening fence, body, the line above the fence) of every
    ``` block of a page."""
    lines = page.read_text().splitlines(keepends=True)
    start = None
    for i, x in enumerate(lines):
        if not x.startswith("```"):
            continue
        if start is None:
            start = i
            continue
        above = next((y for y in reversed(lines[:start]) if y.strip()), "")
        yield lines[start][3:].strip(), start + 1, "".join(lines[start + 1:i]), above.strip()
        start = None


def code_blocks():
    """(page, line, code, the reason it is not run or None) of every python block."""
    for page in PAGES:
        for info, line, body, above in fenced_blocks(page):
            if info == "python":
                mark = NOT_RUN.search(above)
                yield page.relative_to(ROOT), line, body, mark and mark.group(1)


BLOCKS = list(code_blocks())


def test_the_pages_have_blocks_and_every_mark_precedes_one():
    assert len(BLOCKS) >= 10, [b[:2] for b in BLOCKS]
    other_python = [f"{p.name}:{line} ```{info}" for p in PAGES
                    for info, line, _, _ in fenced_blocks(p)
                    if info != "python" and re.match(r"py", info, re.I)]
    assert not other_python, f"write python blocks as ```python, so they run: {other_python}"
    marks = sum(len(re.findall(r"<!--\s*not run:", p.read_text())) for p in PAGES)
    assert marks == sum(b[3] is not None for b in BLOCKS), \
        "a `<!-- not run: ... -->` mark must sit on the line just above a ```python block"


@pytest.mark.parametrize("page,line,code,reason",
                         [pytest.param(*b, id=f"{b[0]}:{b[1]}") for b in BLOCKS])
def test_example_runs_as_written(page, line, code, reason, monkeypatch):
    if reason is not None:
        pytest.skip(f"marked in {page}: not run: {reason}")
    monkeypatch.chdir(ROOT)            # paths in the docs are relative to the checkout
    name = f"{page}:{line}"
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # tracebacks
    program = compile(code, name, "exec")
    if NUMPY_FOR_CUPY.search(code):
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "cupy", np)
            exec(program, {"__name__": "__main__"})
        if not HAS_GPU:
            return
    exec(program, {"__name__": "__main__"})


# -- sessions: `>>> call` then the error it raises, as docs/api.md's "Errors" shows -------

SESSION_LINE = re.compile(r"^>>> (.*)$")
RAISED = re.compile(r"^(\w+(?:Error|Warning)): (.*)$")


def sessions():
    """(page, line, [(statement, (error name, message) or None)]) of every plain block
    that holds `>>>` lines."""
    for page in PAGES:
        for info, line, body, _ in fenced_blocks(page):
            if info or not any(SESSION_LINE.match(x) for x in body.splitlines()):
                continue
            steps = []
            for x in body.splitlines():
                if (stmt := SESSION_LINE.match(x)):
                    steps.append([stmt.group(1), None])
                elif (err := RAISED.match(x)) and steps and steps[-1][1] is None:
                    steps[-1][1] = err.groups()
                else:
                    raise AssertionError(f"{page}:{line}: a session line that is neither "
                                         f"`>>> ...` nor `SomeError: message`: {x!r}")
            yield page.relative_to(ROOT), line, steps


SESSIONS = list(sessions())


def test_there_are_sessions():
    assert SESSIONS, "docs/api.md's Errors section shows a `>>>` session"


@pytest.mark.parametrize("page,line,steps",
                         [pytest.param(*s, id=f"{s[0]}:{s[1]}") for s in SESSIONS])
def test_documented_errors_are_the_real_ones(page, line, steps):
    namespace = {}
    for stmt, raised in steps:
        if raised is None:
            exec(stmt, namespace)
            continue
        with pytest.raises(Exception) as info:
            exec(stmt, namespace)
        assert (type(info.value).__name__, str(info.value)) == tuple(raised), stmt
