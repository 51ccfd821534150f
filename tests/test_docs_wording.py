"""README.md and docs/ describe the product as it is, not how it was built: no work
sessions, no build "turns", no issue numbers. History belongs in git; a measured
figure belongs in docs/benchmarks.md with its date, machine and command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ORDINAL = (r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
           r"thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
           r"\d+(?:st|nd|rd|th))")

BUILD_DIARY = [
    # "session", "the seventh session's": a work session, never a product concept here
    # (`requests.Session` and `ClientSession` are left alone).
    (re.compile(r"(?<![.\w])sessions?\b", re.IGNORECASE), "a work session"),
    # "this turn", "the third turn", "turn 3"; "in turn", "taking turns", "turns it off" pass.
    (re.compile(rf"\b(?:this|that|each|every|next|previous|last|later|earlier|{ORDINAL})\s+turn(?:s|'s)?\b",
                re.IGNORECASE), "a build turn"),
    (re.compile(r"\bturn\s+\d+\b", re.IGNORECASE), "a build turn"),
    # "issue #17", "issue 17", "the target"
    (re.compile(r"\bissues?\s*#?\s*\d+\b", re.IGNORECASE), "an issue number"),
    (re.compile(r"\b(?:the|this|that) issue's\b", re.IGNORECASE), "the project's issue"),
    # a bare "#17"; not a markdown anchor "](#...)", "page.md#...", "owner/repo#123" or "&#123;"
    (re.compile(r"(?<![\w/#&])(?<!\]\()#\d+\b"), "an issue number"),
]


def build_diary_wording(text: str) -> list[tuple[int, str, str]]:
    """(line number, offending phrase, what it reads as) for every hit in `text`."""
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        spans: list[tuple[int, int]] = []
        for pattern, reads_as in BUILD_DIARY:
            for match in pattern.finditer(line):
                if not any(start <= match.start() and match.end() <= end for start, end in spans):
                    spans.append(match.span())
                    hits.append((number, match.group(0), reads_as))
    return hits


def product_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("text", [
    "the seventh session's figure",
    "Measured in the sixteenth session.",
    "issue #17",
    "Issue 17's target",
    "the issue's 1.2× target",
    "as #17 measured",
    "(#17)",
    "this turn",
    "the detokenizer's third turn",
    "in turn 3",
    "Sessions before this one",
])
def test_the_matcher_catches_build_diary_wording(text):
    assert build_diary_wording(text), f"{text!r} was not caught"


@pytest.mark.parametrize("text", [
    "in turn",
    "the variants alternate, taking turns round by round",
    "`-p no:kvforge` turns it off",
    "[link](#anchor)",
    "[figures](benchmarks.md#2026-12-01-run)",
    "[numbered](#1-setup)",
    "flashinfer-ai/flashinfer#3617",
    "`requests.Session()` and `aiohttp.ClientSession`",
    "a known issue with the driver",
    "request `r` runs internally as `r#i`",
])
def test_the_matcher_passes_product_wording(text):
    assert not build_diary_wording(text)


def test_readme_and_docs_describe_the_product_not_its_build_history():
    found = [f"{page.relative_to(ROOT)}:{line}: {phrase!r} ({reads_as})"
             for page in product_pages()
             for line, phrase, reads_as in build_diary_wording(page.read_text(encoding="utf-8"))]
    assert not found, ("README.md and docs/ describe the product as it is now; rewrite these lines without "
                       "build history (put a measured figure in docs/benchmarks.md with its date, machine "
                       "and command):\n" + "\n".join(found))
