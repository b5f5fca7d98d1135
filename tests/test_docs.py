"""The documentation holds together: every relative link in README.md and docs/*.md reaches a file (and, with a
``#fragment``, a heading of it), every Python block of the README parses, the README's Quickstart is the two
commands CI runs, and the README stays a front page."""

import ast
import re
import textwrap
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^ *(```|~~~)(\w*)[^\n]*\n(.*?)^ *\1 *$", re.M | re.S)
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
# [text](target) and ![alt](target); the target up to the first space (an optional "title" may follow).
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text):
    """The text without fenced blocks and inline code, where a bracket is code, not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _blocks(text, lang):
    """The bodies of the fenced code blocks of one language, dedented (blocks may sit inside list items)."""
    return [textwrap.dedent(m.group(3)) for m in FENCE.finditer(text) if m.group(2) == lang]


def _slug(heading):
    """GitHub's anchor for a heading: the rendered text (code marks and link targets dropped), lower case,
    punctuation other than '-' and '_' removed, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def _anchors(path):
    seen, anchors = {}, set()
    for m in HEADING.finditer(FENCE.sub("", path.read_text(encoding="utf-8"))):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _relative_links(path):
    for target in LINK.findall(_prose(path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        yield target


def broken_links(path):
    """Each relative link of ``path`` that reaches no file, or no heading of its file, with the reason."""
    broken = []
    for target in _relative_links(path):
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif fragment and dest.suffix == ".md" and unquote(fragment).lower() not in _anchors(dest):
            broken.append(f"{target}: no heading '#{fragment}' in {dest.name}")
    return broken


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = broken_links(path)
    assert not broken, "broken links in " + path.name + ":\n" + "\n".join(broken)


def test_the_link_check_sees_a_broken_link_and_a_missing_heading(tmp_path):
    # The check itself, on a page made for it: a test that cannot fail would pass the docs whatever they say.
    (tmp_path / "there.md").write_text("# A page\n\n## Some section: with `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#some-section-with-code) [ok](#local)\n\n## Local\n\n"
        "[gone](missing.md) [no heading](there.md#nowhere) `[code](not-a-link.md)` [web](https://example.com)\n"
    )
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "there.md#nowhere"]


def test_the_docs_link_each_other():
    # Every page is reachable from the README, directly or through another page.
    reached, todo = set(), [README]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for target in _relative_links(page):
            dest = (page.parent / unquote(target.partition("#")[0] or page.name)).resolve()
            if dest.suffix == ".md" and dest.exists():
                todo.append(dest)
    assert sorted(p.name for p in PAGES if p.resolve() not in reached) == []


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_parses(path):
    for block in _blocks(path.read_text(encoding="utf-8"), "python"):
        ast.parse(block)


def test_readme_has_python_blocks():
    assert len(_blocks(README.read_text(encoding="utf-8"), "python")) >= 1


def test_quickstart_is_the_two_commands_ci_runs():
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    commands = [line for line in _blocks(section, "bash")[0].splitlines() if line.strip()]
    assert commands == [
        'pip install torch==2.13.0 -e ".[demo]" && python -m zero_offload.demo',
        'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q',
    ]
    # CI runs the second one as a user does: a fresh venv (not over the base interpreter's packages), activated, then
    # its install, then the suite, in that order, as commands (not in a comment).
    install, run = commands[1].split(" && ")
    ci = _commands(ROOT / ".ci" / "run")
    made = [m.group(1) for m in map(re.compile(r'python3 -m venv "\$WORK/(\w+)"').fullmatch, ci) if m]
    assert len(made) == 1, made
    order = [ci.index(f'python3 -m venv "$WORK/{made[0]}"'), ci.index(f'source "$WORK/{made[0]}/bin/activate"'),
             ci.index(install.replace("pip install ", "pip install -q ")), ci.index(run), ci.index("deactivate")]
    assert order == sorted(order), order


def _commands(path):
    """A shell script's lines without comments (whole-line or trailing), stripped; blank lines left out."""
    lines = (re.sub(r"\s+#\s.*$", "", ln).strip() for ln in path.read_text(encoding="utf-8").splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_readme_is_a_front_page():
    assert len(README.read_text(encoding="utf-8").splitlines()) < 250


def test_ci_runs_the_first_quickstart_command_on_a_fresh_clone():
    # .ci/frontdoor.sh (called by .ci/run) runs the first command in fresh venvs, over a cache with stale locks.
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    install, run = _blocks(section, "bash")[0].splitlines()[0].split(" && ")
    frontdoor = (ROOT / ".ci" / "frontdoor.sh").read_text(encoding="utf-8")
    # The venv's own pip and python run them: "$WORK/a/bin/pip" install -q ..., "$WORK/a/bin/python" -m ...
    assert install.replace("pip install ", 'pip" install -q ') in frontdoor
    assert run.replace("python ", 'python" ') in frontdoor
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert any(line.startswith("start_bg frontdoor ") and line.endswith(" .ci/frontdoor.sh") for line in ci)
    assert "join_bg frontdoor" in ci
    # The venv that runs it first is made as a user makes one: not over the base interpreter's packages.
    assert "new_venv a" in _commands(ROOT / ".ci" / "frontdoor.sh")
