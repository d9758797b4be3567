"""The README and the docs pages hold together: the README links every page, every page links
back, and every relative link or image leads to a file that exists and, with a #fragment, to a
heading on it, as GitHub names its anchors."""

from __future__ import annotations

import re
from pathlib import Path

from readme_blocks import REPO, pages

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _outside_fences(text: str) -> list[str]:
    """TEXT's lines outside ``` fences: a `#` in a shell block is no heading, nor a `](` in a
    command's output a link."""
    lines, fence = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives TEXT's headings: lower case, punctuation dropped, spaces made
    hyphens, and -1, -2 ... after a repeat."""
    seen: dict[str, int] = {}
    for line in _outside_fences(text):
        if m := re.match(r"^#{1,6} (.+)$", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def links(page: str, text: str) -> list[tuple[str, Path, str]]:
    """Every relative link on PAGE: (as written, the file it leads to, its #fragment or '')."""
    found = []
    for line in _outside_fences(text):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto: ...
            path, _, fragment = target.partition("#")
            found.append((target, (REPO / page).parent / path if path else REPO / page,
                          fragment))
    return found


def test_anchors_are_githubs():
    assert anchors("## `kvcache size`: how big is the cache, and what fits\n") == {
        "kvcache-size-how-big-is-the-cache-and-what-fits"}
    assert anchors("## A trained model, offline: `--model stdlib-bytes`\n") == {
        "a-trained-model-offline---model-stdlib-bytes"}
    assert anchors("## Notes\n```bash\n# a comment\n```\n## Notes\n") == {"notes", "notes-1"}


def test_the_readme_links_every_docs_page_and_each_links_back():
    texts = pages()
    linked = {path.resolve() for _, path, _ in links("README.md", texts["README.md"])}
    for page, text in texts.items():
        if page == "README.md":
            continue
        assert (REPO / page).resolve() in linked, f"README.md does not link {page}"
        back = {path.resolve() for _, path, _ in links(page, text)}
        assert (REPO / "README.md").resolve() in back, f"{page} does not link back to README.md"


def test_every_link_and_image_on_every_page_resolves():
    texts = pages()
    problems = []
    for page, text in texts.items():
        for target, path, fragment in links(page, text):
            if not path.is_file():
                problems.append(f"{page}: ({target}) leads to no file")
            elif fragment and fragment not in anchors(path.read_text(encoding="utf-8")):
                problems.append(f"{page}: ({target}) leads to no heading")
    assert not problems, "\n".join(problems)
