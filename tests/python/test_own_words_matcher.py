"""The matcher of scripts/own_words.py, on texts made at test time from the
seed and the upstream files (nothing outside is stored here): which lines it
counts, that a run of six is found and five is not, that re-spacing,
re-quoting, re-indenting and dropping comments do not hide a copy, that the
lines it ignores neither count nor break a run, and the script's output and
exit statuses.  tests/python/test_own_words.py runs it over the whole tree."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import own_words  # noqa: E402
import reference_loader  # noqa: E402

SCRIPT = os.path.join(ROOT, "scripts", "own_words.py")


@pytest.fixture(scope="module")
def sources():
    try:
        return own_words.load_sources(reference_loader.shared_dir(), own_words.MIN_RUN)
    except reference_loader.ReferenceUnavailable as e:
        reference_loader.unavailable(str(e))


@pytest.fixture(scope="module")
def block():
    """The longest statement block of the seed: the code of one member, its
    significant lines in the code view, as (seed line, raw line) pairs."""
    text = reference_loader.read_seed()
    best = max((m for m in reference_loader.parse_seed(text) if m.source),
               key=lambda m: len(m.source))
    code = "\n".join(best.source)
    keep = {no for no, _ in own_words.significant_lines(code, "code")}
    return [(best.source_line + i, ln) for i, ln in enumerate(best.source)
            if i + 1 in keep]


def _file(lines):
    return "\n".join(lines) + "\n"


def test_the_lines_that_count():
    text = _file([
        '"""A module docstring, prose."""',
        "import os",
        "from typing import (",
        "    Any,",
        ")",
        "",
        "LIMIT = 16",
        "SIZES = {'a': 1, 'b': 2 * 1024}",
        "TABLE = {",
        "    'KVCache': 'supported',",
        "}",
        "@staticmethod",
        "def f(",
        "    a: int,",
        ") -> int:",
        "    '''One line of docstring.'''",
        "    # a comment",
        "    x = compute(a)  # trailing",
        "    return {",
        "    }",
    ])
    text_view = [t for _, t in own_words.significant_lines(text, "text")]
    code_view = [t for _, t in own_words.significant_lines(text, "code")]
    assert text_view == ['"""Amoduledocstring,prose."""', '"""Onelineofdocstring."""',
                         "#acomment", "x=compute(a)#trailing", "return{"]
    assert code_view == ["x=compute(a)", "return{"]


def _runs(sources, text):
    return own_words.runs_in("probe.py", text, sources)


def test_six_lines_are_a_run_five_are_not(sources, block):
    assert len(block) >= 12
    six = [ln for _, ln in block[:6]]
    five = [ln for _, ln in block[:5]]
    mine = ["mine_%d = object()" % i for i in range(3)]
    runs = _runs(sources, _file(mine + six + mine))
    assert [(r["first"], r["last"], r["lines"]) for r in runs] == [(4, 9, 6)]
    assert runs[0]["source"] == reference_loader.SEED_NAME
    assert runs[0]["source_line"] == block[0][0]
    assert _runs(sources, _file(mine + five + mine)) == []
    # Two pieces of five with our own line between them are not a run either.
    split = five + ["ours = object()"] + [ln for _, ln in block[5:10]]
    assert _runs(sources, _file(split)) == []


def test_respacing_quotes_indent_and_dropped_comments_do_not_hide_a_copy(sources, block):
    copied = [ln for _, ln in block[:8]]
    disguised = []
    for ln in copied:
        ln = ln.strip().replace('"', "'").replace(", ", ",  ").replace(" = ", "=")
        disguised.append("        " + ln)
    runs = _runs(sources, _file(["def mine():"] + disguised))
    assert runs and runs[0]["lines"] >= 8
    # Comments interleaved (ours) break the text view, not the code view.
    noisy = []
    for ln in copied:
        noisy += ["    # our note", "    " + ln.strip()]
    assert _runs(sources, _file(noisy))


def test_ignored_lines_neither_count_nor_break_a_run(sources, block):
    copied = [ln.strip() for _, ln in block[:6]]
    filler = ["", "import json", "LIMIT = 7", ")", "@property", "def g(self) -> int:"]
    mixed = []
    for ln, fill in zip(copied, filler):
        mixed += [ln, fill]
    runs = _runs(sources, _file(mixed))
    assert len(runs) == 1 and runs[0]["lines"] == 6
    # Signatures, imports and constants of the reference alone are facts.
    text = reference_loader.read_seed()
    facts = []
    for m in reference_loader.parse_seed(text):
        if m.source:
            facts += [ln.strip() for ln in m.source
                      if ln.strip().startswith(("def ", "async def ", "@"))]
        elif "module-attribute" in m.tags or "class-attribute" in m.tags:
            facts += [ln.strip() for ln in m.text if ln.strip()][:1]
    assert len(facts) > 40
    assert _runs(sources, _file(facts)) == []


def test_upstream_files_are_sources_too(sources):
    up = os.path.join(reference_loader.shared_dir(), "upstream")
    path = next(os.path.join(d, f) for d, _, fs in sorted(os.walk(up)) for f in sorted(fs)
                if f.endswith(".py"))
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    runs = _runs(sources, text)
    assert runs and runs[0]["source"] == os.path.relpath(path, reference_loader.shared_dir())


def test_script_lists_runs_with_file_and_line(tmp_path, sources, block):
    probe = tmp_path / "probe.py"
    probe.write_text(_file(["x = 1"] + [ln for _, ln in block[:7]]), encoding="utf-8")
    r = subprocess.run([sys.executable, SCRIPT, str(probe)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1, r.stderr
    (line,) = r.stdout.splitlines()
    assert line.endswith(f"probe.py:2-8: 7 lines also in {reference_loader.SEED_NAME}:"
                         f"{block[0][0]}"), line
    clean = tmp_path / "clean.py"
    clean.write_text(_file(["def ours():", "    return 42"]), encoding="utf-8")
    r = subprocess.run([sys.executable, SCRIPT, str(clean)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
    r = subprocess.run([sys.executable, SCRIPT, "--shared", str(tmp_path / "none"),
                        str(clean)], capture_output=True, text=True, timeout=300)
    assert r.returncode == own_words.EXIT_UNAVAILABLE and "not found" in r.stderr
