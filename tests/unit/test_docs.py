"""The docs stay true to the repository: links resolve, the README's commands exist, nothing
points outside the repository.

1. Every relative link in README.md and docs/*.md names a file or folder of the repository, and
   every ``#anchor`` into a markdown file names one of its headings (GitHub's slugs).
2. Every command the README shows in its shell blocks exists: each ``paramserver``,
   ``paramctl``, ``paramworker`` and ``paramrouter`` subcommand and each ``python -m MODULE
   [subcommand]`` of this repository answers ``--help`` with exit 0. The README starts with the
   two commands, and its test command is exactly what .ci/run runs.
3. No text file of the repository (tracked, or new and not ignored) refers to a path outside the repository (a design document beside the
   clone, a workspace folder): a fresh clone must be complete.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 220

# Pages another change adds; a link to one of them may dangle until it lands. Empty this set
# once they are merged: from then on a missing file fails the test like any other.
PENDING: set[str] = set()

# The console scripts of pyproject.toml's [project.scripts], run as ``python -m`` of their module.
CONSOLE_SCRIPTS = {
    "paramserver": "paramserver.server.cli",
    "paramctl": "paramserver.client.ctl",
    "paramworker": "worker.cli",
    "paramrouter": "worker.router",
}
PACKAGES = ("chunking", "consensus", "paramserver", "worker", "deploy", "bench")

FENCE = re.compile(r"^(```|~~~)(.*)$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`]*`")


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def prose_and_code(path: Path) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The file's lines outside fenced blocks, and its fenced blocks as (language, lines)."""
    prose: list[str] = []
    blocks: list[tuple[str, list[str]]] = []
    fence: str | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line.strip())
        if fence is None and m:
            fence = m.group(1)
            blocks.append((m.group(2).strip().lower(), []))
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is not None:
            blocks[-1][1].append(line)
        else:
            prose.append(line)
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = prose_and_code(path)
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    prose, _ = prose_and_code(path)
    links: list[str] = []
    for line in prose:
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            links.append(target)
    return links


def test_readme_is_short_and_docs_exist() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; keep it at most {README_MAX_LINES}"
    assert (ROOT / "docs" / "README.md").is_file()


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken: list[str] = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        try:
            rel = dest.relative_to(ROOT).as_posix()
        except ValueError:
            broken.append(f"{target}: outside the repository")
            continue
        if not dest.exists():
            if rel not in PENDING:
                broken.append(f"{target}: no such file {rel}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {rel}")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links:\n  " + "\n  ".join(broken)


def shell_lines(doc: Path) -> list[str]:
    """The lines of the file's shell blocks (```bash and the like; a bare ``` block is a picture)."""
    _, blocks = prose_and_code(doc)
    return [line for lang, lines in blocks if lang in ("bash", "sh", "shell", "console") for line in lines]


def table_commands(doc: Path) -> list[str]:
    """Commands named in code spans of table rows, ``paramctl push / pull`` read as two commands."""
    prose, _ = prose_and_code(doc)
    out: list[str] = []
    for line in prose:
        if not line.lstrip().startswith("|"):
            continue
        for span in CODE_SPAN.findall(line):
            words = span.strip("`").split(" / ")
            first = words[0].split()
            if not first:
                continue
            # "paramctl push / pull": every alternative after the first is a subcommand of the same head
            head = first[:-1] if len(first) > 1 and len(words) > 1 else first
            out.append(" ".join(first))
            out.extend(" ".join([*head, w.strip()]) for w in words[1:])
    return out


def commands_of(line: str) -> list[list[str]]:
    """The simple commands of one shell line: split at && ; | &, comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set("&;|()"):
            out.append([])
        else:
            out[-1].append(token)
    return [c for c in out if c]


def help_command(words: list[str]) -> tuple[str, ...] | None:
    """The ``python -m MODULE [subcommand ...] --help`` that checks one README command, or None."""
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return None
    head = Path(words[0]).name
    if words[0] in CONSOLE_SCRIPTS:
        module, rest = CONSOLE_SCRIPTS[words[0]], words[1:]
    elif re.fullmatch(r"python[0-9.]*", head) and len(words) >= 3 and words[1] == "-m":
        module, rest = words[2], words[3:]
        if module.split(".")[0] not in PACKAGES:
            return None  # venv, pip, pytest: not this repository's
    else:
        return None
    sub: list[str] = []
    for word in rest:  # the subcommand words, up to the first option
        if word.startswith("-"):
            break
        sub.append(word)
    return (module, *sub, "--help")


def readme_help_commands() -> list[tuple[str, ...]]:
    lines = [*shell_lines(README), *table_commands(README)]
    found: list[tuple[str, ...]] = []
    for line in lines:
        for words in commands_of(line):
            cmd = help_command(words)
            if cmd is not None and cmd not in found:
                found.append(cmd)
    return found


def test_readme_starts_with_the_two_commands() -> None:
    _, blocks = prose_and_code(README)
    first = [line for line in blocks[0][1] if line.strip() and not line.lstrip().startswith("#")]
    assert len(first) == 2, f"the README's first code block should hold exactly the two commands, got {first}"
    assert first[0].endswith("python -m deploy.demo"), first[0]
    ci = [line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines() if line.startswith("$PY -m venv")]
    assert len(ci) == 1, "could not find the test command in .ci/run"
    assert first[1] == ci[0].replace("$PY", "python3.11", 1), "the README's test command must be exactly what .ci/run runs"


# Runs each command as ``python -m`` would (runpy, as __main__), all in one child process so the
# heavy imports (torch, grpc) are paid once; prints one line per command: its exit status.
HELP_RUNNER = """
import contextlib, io, json, runpy, sys
for cmd in json.loads(sys.argv[1]):
    sys.argv = [cmd[0], *cmd[1:]]
    buf = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            runpy.run_module(cmd[0], run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:
            code, _ = 1, buf.write(repr(e))
    print(json.dumps([cmd, code, buf.getvalue()[-300:]]), flush=True)
"""


def test_readme_commands_answer_help() -> None:
    commands = readme_help_commands()
    modules = {c[0] for c in commands}
    # The README shows the demo, the local cluster and each CLI; if the parser stops finding
    # them, the test would check nothing.
    assert set(CONSOLE_SCRIPTS.values()) | {"deploy.demo", "deploy.local"} <= modules, modules
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", HELP_RUNNER, json.dumps(commands)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("[")]
    assert len(results) == len(commands), f"the runner stopped early (exit {r.returncode}):\n{r.stderr[-2000:]}"
    failed = [f"python -m {' '.join(cmd)}: exit {code}\n{tail}" for cmd, code, tail in results if code != 0]
    assert not failed, "README commands that do not answer --help:\n" + "\n".join(failed)


# Built from parts so that this file does not match itself.
OUTSIDE = [
    "../" + "shared",
    "shared/" + "DESIGN" + ".md",
    "DESIGN" + ".md",
    "/tmp/" + "me",
    "/" + "work/",
    "/ho" + "me/",
]


def tracked_text_files() -> list[Path]:
    try:
        ls = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
        names = subprocess.run(ls, cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
        files = [ROOT / n.decode() for n in names if n]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
        files = [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]
    return [f for f in files if f.is_file()]


def test_nothing_refers_outside_the_repository() -> None:
    hits: list[str] = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for n, line in enumerate(text.splitlines(), 1):
            for needle in OUTSIDE:
                if needle in line:
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {needle!r}: {line.strip()[:120]}")
    assert not hits, "files that refer to something outside the repository:\n" + "\n".join(hits)
