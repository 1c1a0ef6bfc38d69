"""The project's words speak of its code and its runs: the README, docs/, CITATION.cff, and the comments, docstrings
and strings (help text, messages) of the scripts, tools and tests name commands, machines, dates and commits, never
how the project itself was put together or a path of the machine it was written on. FORBIDDEN lists the words, each
with the legitimate uses it lets through; a hit is reported as file:line and the line."""

import io
import pathlib
import re
import tokenize

from conftest import ROOT

FORBIDDEN = {
    # pytest's own term ("once per test session", scope="session") is the one session a test may speak of
    "a working session": re.compile(r'(?<!test )(?<![\w"])sessions?\b(?!")', re.I),
    # an attribute path (submitit.helpers) is code, not a word about the project
    "a helper": re.compile(r"(?<![\w.])helpers?\b", re.I),
    "the document the project started from": re.compile(r"\bseed[- ]doc(ument)?s?\b", re.I),
    # a tracker's issue is named by its link (github.com/openai/phasic-policy-gradient/issues/7) or as
    # owner/repo#7, never by a bare number
    "an issue number": re.compile(r"\bissues?\s+#?\d|(?<![\w/])#\d+\b", re.I),
    "a task card": re.compile(r"\bcards?\b", re.I),
    "a watcher": re.compile(r"\bwatchers?\b", re.I),
    "the machine the project was written on": re.compile(r"/work\b/"),
    "the team": re.compile(r"\bthe team\b", re.I),
}


def prose_files() -> list:
    return [ROOT / "README.md", ROOT / "CITATION.cff", *sorted((ROOT / "docs").glob("**/*.md"))]


def code_files() -> list:
    """The scripts, tools and tests, but this file: its strings are the examples that the patterns must catch."""
    tests = [path for path in sorted((ROOT / "tests").glob("*.py")) if path.name != pathlib.Path(__file__).name]
    return [*sorted(ROOT.glob("ppg_*.py")), *sorted((ROOT / "tools").glob("*.py")), *tests]


def prose_lines(path) -> list:
    """(line number, text) of every line."""
    return list(enumerate(path.read_text().splitlines(), start=1))


def code_lines(path) -> list:
    """(line number, text) of every line of the file's comments and string literals (docstrings, help text, messages);
    code itself is left out."""
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    lines = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type in kinds:
            first = token.start[0]
            lines += [(first + i, text) for i, text in enumerate(token.string.splitlines())]
    return lines


def hits() -> list:
    found = []
    for files, read in ((prose_files(), prose_lines), (code_files(), code_lines)):
        for path in files:
            for number, text in read(path):
                for what, pattern in FORBIDDEN.items():
                    if pattern.search(text):
                        found.append(f"{path.relative_to(ROOT)}:{number}: {what}: {text.strip()}")
    return found


def test_docs_and_comments_speak_of_the_code_and_its_runs():
    found = hits()
    assert not found, f"{len(found)} lines speak of how the project was built:\n" + "\n".join(found)


def test_the_patterns_catch_what_they_name_and_let_the_legitimate_uses_through():
    caught = [
        "each of four sessions resumed them",
        "Session 4 of 2026-12-06",
        "Helper sessions' test runs",
        "from the seed document",
        "the seed-doc's guard",
        "(issue 46)",
        "issue #45",
        "see #46",
        "The card's packages",
        "A watcher script",
        "the worktree /work/ppg-curve/runs",
        "the team decided",
    ]
    passed = [
        "once per test session",
        'scope="session"',
        "submitit.helpers.Checkpointable",
        "start_new_session=True",
        "github.com/openai/phasic-policy-gradient/issues/7",
        "[openai/phasic-policy-gradient#7](https://github.com/openai/phasic-policy-gradient/issues/7)",
        "the W&B user or team of --track",
        "a GPU's job; see docs/hacking.md",
    ]
    for text in caught:
        assert any(p.search(text) for p in FORBIDDEN.values()), text
    for text in passed:
        assert not any(p.search(text) for p in FORBIDDEN.values()), text
