"""Every relative link in the docs leads somewhere: the file exists, and a ``#fragment``
names a heading of the page it points at (a renamed heading broke three such links once).

Fragments follow GitHub's rule for heading anchors: lower case, punctuation other than
``-`` and ``_`` dropped, spaces as ``-``, and ``-1``, ``-2`` ... for repeated headings.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.servers import REPO

PAGES = sorted({REPO / "README.md", *(REPO / "docs").glob("*.md"), REPO / "sdk" / "README.md",
                REPO / "bench" / "README.md", *(REPO / "terraform").rglob("README.md"),
                *(REPO / "deploy").rglob("*.md")})
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def anchor_of(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text())):
        slug = anchor_of(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def relative_links(page: Path) -> list[str]:
    return [href for href in LINK.findall(FENCE.sub("", page.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", href) and not href.startswith("/")]


def test_the_anchor_rule_matches_githubs() -> None:
    assert anchor_of("Checkpoints that ship their own code (`trust_remote_code`)") == \
        "checkpoints-that-ship-their-own-code-trust_remote_code"
    assert anchor_of("Cluster path: cost per request") == "cluster-path-cost-per-request"
    assert anchor_of("On a GPU") == "on-a-gpu"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_lead_to_a_file_and_a_heading(page: Path) -> None:
    broken = []
    for href in relative_links(page):
        path, _, fragment = href.partition("#")
        target = page if not path else (page.parent / path)
        if not target.exists():
            broken.append(f"{href}: no such file")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(f"{href}: {target.name} has no heading #{fragment}")
    assert not broken, broken
