"""The docs' prose is short: on average at most 25 words a sentence in README.md and each docs/*.md.

Prose is what is left after fenced code blocks, HTML comments, headings and tables are dropped; a list
item's marker is not a word. A sentence ends at `. `, `? ` or `! ` before a capital letter or a backtick,
and at the end of a paragraph or list item (so a heading-like line ending in `:` counts as one sentence).
"e.g.", "i.e.", "vs." and "etc." do not end a sentence. A word is anything between spaces, so a code span
counts as the words it holds.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_WORDS_PER_SENTENCE = 25
ABBREVIATIONS = re.compile(r"\b(e\.g|i\.e|vs|etc|cf)\.", re.I)
SENTENCE_END = re.compile(r"(?<=[.?!])[\"')\]]*\s+(?=[A-Z`])")
LIST_MARKER = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a markdown text, each list item one paragraph of its own."""
    text = re.sub(r"```.*?```", "\n", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", "\n", text, flags=re.S)
    out: list[list[str]] = [[]]
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "|")):
            out.append([])
            continue
        if LIST_MARKER.match(line):
            out.append([])
            stripped = LIST_MARKER.sub("", line).strip()
        out[-1].append(stripped)
    return [" ".join(p) for p in out if p]


def sentences(paragraph: str) -> list[str]:
    protected = ABBREVIATIONS.sub(lambda m: m.group().replace(".", "\0"), paragraph)
    return [s.replace("\0", ".") for s in SENTENCE_END.split(protected) if s.strip()]


def words_per_sentence(text: str) -> tuple[float, int]:
    """(average words a sentence, number of sentences) of a markdown text's prose."""
    found = [s for p in paragraphs(text) for s in sentences(p)]
    return sum(len(s.split()) for s in found) / max(len(found), 1), len(found)


def test_sentence_splitting() -> None:
    text = ("# Title\n\nOne two three. Four `five` six, e.g. seven. Then x vs. y ends here!\n\n"
            "```\nnot. Prose. At all.\n```\n| a. B. | c |\n<!-- A. B. -->\n- item one\n- item two. Second.\n")
    assert [s for p in paragraphs(text) for s in sentences(p)] == [
        "One two three.", "Four `five` six, e.g. seven.", "Then x vs. y ends here!", "item one", "item two.",
        "Second."]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_docs_average_at_most_25_words_a_sentence(path: Path) -> None:
    average, count = words_per_sentence(path.read_text())
    print(f"{path.relative_to(ROOT)}: {average:.1f} words a sentence over {count} sentences")
    assert average <= MAX_WORDS_PER_SENTENCE, (f"{path.relative_to(ROOT)}: {average:.1f} words a sentence on "
                                               f"average; split sentences to {MAX_WORDS_PER_SENTENCE} or fewer")
