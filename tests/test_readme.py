"""The README as a user follows it: every code block runs as written, and the output it shows is what comes out.

Each fenced ``python`` block runs as a script in a fresh process (the repo's
python, this checkout's ``omnistage`` first on ``PYTHONPATH``), in an empty
folder of its own. Each ``bash`` block runs under ``bash -e`` with
``omnistage`` and ``python`` on ``PATH`` (shims for this checkout, standing
in for what ``make`` installs into ``.venv/bin``).

Markers, as HTML comments on the line before a fence (invisible on GitHub):

- ``<!-- readme-test: skip (why) -->``: the block is not run; the reason is
  required (a block that installs, runs the whole suite, or serves forever).
- ``<!-- readme-test: output -->`` before a ``text`` block: what the nearest
  run block above prints. Each of its lines must match a line of that block's
  stderr-then-stdout, in order (other lines may come between); in the shown
  text ``N`` stands for any number (timings) and ``...`` for anything.
- ``<!-- readme-test: server -->`` before a ``bash`` block that starts a
  server: it runs in the background, its port ``8000`` made ``0`` (a free
  one), until it says ``listening on http://HOST:PORT``; then the next run
  block (its client) runs with ``8000`` made ``PORT``, and the server is
  stopped with Ctrl-C (SIGINT), as a user would.

Every fence names its language, one of python, bash, text: an example in
another language would go untested.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUN_LANGUAGES = ("python", "bash")
LANGUAGES = (*RUN_LANGUAGES, "text")
BLOCK_TIMEOUT_S = 600  # one model load and a few steps; generous for a busy shared CPU
README_PORT = "8000"  # the port the README's server examples use

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->$")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    marker: str | None  # the readme-test marker before the fence, if any
    expected: Block | None = None  # the output block that follows, for a run block
    client: Block | None = None  # for a server block: the run block after it, run while it serves
    served: bool = False  # a client block: runs inside its server's test

    @property
    def runs(self) -> bool:
        return self.language in RUN_LANGUAGES and self.skip_reason is None

    @property
    def skip_reason(self) -> str | None:
        if self.marker is None or not self.marker.startswith("skip"):
            return None
        match = re.fullmatch(r"skip \((.+)\)", self.marker)
        assert match, f"README.md:{self.line}: a skip marker needs a reason: 'skip (why)', got {self.marker!r}"
        return match.group(1)


def parse_blocks(text: str) -> list[Block]:
    """The fenced blocks of ``text`` with their markers; each ``output`` block
    is attached to the nearest run block above it."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        assert j < len(lines), f"README.md:{start + 1}: a code block is never closed"
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = _MARKER.match(lines[k].strip()) if k >= 0 else None
        blocks.append(Block(start + 1, fence.group(1), "\n".join(lines[start + 1 : j]) + "\n",
                            marker.group(1) if marker else None))  # fmt: skip
        i = j + 1
    for n, block in enumerate(blocks):
        if block.marker == "server":
            assert block.language == "bash", f"README.md:{block.line}: a server block is a ```bash block"
            clients = [b for b in blocks[n + 1 :] if b.runs and b.marker != "server"]
            assert clients, f"README.md:{block.line}: a server block with no client block after it"
            block.client = clients[0]
            clients[0].served = True
        if block.marker == "output":
            assert block.language == "text", f"README.md:{block.line}: an output block is a ```text block"
            runs = [b for b in blocks[:n] if b.runs]
            assert runs, f"README.md:{block.line}: an output block with no run block above it"
            assert runs[-1].expected is None, f"README.md:{block.line}: a second output block for one run block"
            runs[-1].expected = block
    return blocks


def _readme_blocks() -> list[Block]:
    return parse_blocks(README.read_text(encoding="utf-8"))


def _run_blocks() -> list[object]:  # pytest.param sets
    params = []
    for block in _readme_blocks():
        if block.language not in RUN_LANGUAGES or block.served:
            continue
        marks = [pytest.mark.skip(reason=f"README.md:{block.line}: {block.skip_reason}")] if block.skip_reason else []
        params.append(pytest.param(block, id=f"README.md:{block.line}-{block.language}", marks=marks))
    return params


# -- what the README shows, checked without running anything -----------------------


def test_every_fence_names_a_language_this_test_knows():
    for block in _readme_blocks():
        assert block.language in LANGUAGES, (
            f"README.md:{block.line}: ```{block.language} is not one of {LANGUAGES}; an example there would go untested"
        )
        if block.marker is not None:
            known = block.marker in ("output", "server") or block.skip_reason
            assert known, f"README.md:{block.line}: unknown marker {block.marker!r}"


def test_the_readme_shows_something_that_runs():
    blocks = [b for b in _readme_blocks() if b.runs]
    assert {b.language for b in blocks} == set(RUN_LANGUAGES)
    assert any(b.expected is not None for b in blocks), "the quickstart shows what a user sees"


def test_the_layout_table_names_every_package_folder_and_links_the_design():
    text = README.read_text(encoding="utf-8")
    assert "(docs/design.md)" in text, "the README links the design document"
    assert "../shared" not in text, "a fresh clone has nothing outside the repository"
    assert "lint-imports" in text
    rows = re.findall(r"^\| `omnistage/([\w/]+)/` \|", text, flags=re.M)
    top = {r for r in rows if "/" not in r}
    packages = {p.parent.name for p in (ROOT / "omnistage").glob("*/__init__.py")}
    assert top == packages, f"layout table {sorted(top)} vs the package's folders {sorted(packages)}"
    for row in rows:
        assert (ROOT / "omnistage" / row / "__init__.py").is_file(), f"the layout table names omnistage/{row}/"
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    for name in top:
        assert f"{name}/" in design, f"docs/design.md does not place {name}/"


def test_the_relative_links_and_paths_the_readme_names_exist():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#:]+)\)", text)  # markdown links without a scheme
    paths = re.findall(r"`((?:omnistage|docs|benchmarks|tests)/[\w./-]+)`", text)
    for path in [*links, *paths]:
        assert (ROOT / path).exists(), f"README names {path}, which this checkout does not have"


def test_output_lines_match_with_placeholders():
    assert _matches_in_order("a\nloaded X in N s\nb", ["x", "a", "loaded X in 3.25 s", "z", "b"])
    assert _matches_in_order("{...} done", ['{"id": 1} done'])
    assert not _matches_in_order("b\na", ["a", "b"])  # order matters
    assert not _matches_in_order("loaded in N s", ["loaded in soon s"])


# -- running the blocks -------------------------------------------------------------


def _shim_dir(tmp: Path) -> Path:
    """``omnistage`` and ``python`` as ``make`` would install them, for this checkout."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    python = shlex.quote(sys.executable)
    for name, target in (("omnistage", f"{python} -m omnistage.entrypoints.cli"), ("python", python)):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def _env(bin_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    # Small models gain nothing from intra-op threads, and on a busy shared CPU the
    # thread barriers cost more than the math (see tests/conftest.py); a caller's choice wins.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _line_pattern(shown: str) -> re.Pattern[str]:
    parts = re.split(r"(\.\.\.|\bN\b)", shown.strip())
    wild = {"...": ".*", "N": r"[0-9][0-9.,]*"}
    return re.compile("".join(wild.get(p, re.escape(p)) for p in parts))


def _matches_in_order(shown: str, actual: list[str]) -> bool:
    patterns = [_line_pattern(line) for line in shown.splitlines() if line.strip()]
    it = iter(line.strip() for line in actual)
    return all(any(p.fullmatch(line) for line in it) for p in patterns)


def _command(block: Block, work: Path, code: str) -> list[str]:
    if block.language == "python":
        script = work / f"readme_block_{block.line}.py"
        script.write_text(code)
        return [sys.executable, script.name]
    return ["bash", "-e", "-o", "pipefail", "-c", code]


def _report(block: Block, returncode: int | None, stdout: str, stderr: str) -> str:
    return (
        f"README.md:{block.line} ({block.language}) exited {returncode}\n"
        f"--- stdout\n{stdout}\n--- stderr\n{stderr}"
    )


def _check(block: Block, work: Path, env: dict[str, str], port: str = README_PORT) -> None:
    """Run ``block`` to its end; it must succeed and print what the README shows after it."""
    code = re.sub(rf"\b{README_PORT}\b", port, block.code)
    result = subprocess.run(
        _command(block, work, code), cwd=work, env=env, capture_output=True, text=True,
        timeout=BLOCK_TIMEOUT_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    report = _report(block, result.returncode, result.stdout, result.stderr)
    assert result.returncode == 0, report
    _check_output(block, result.stderr.splitlines() + result.stdout.splitlines(), report, port)


def _check_output(block: Block, actual: list[str], report: str, port: str = README_PORT) -> None:
    if block.expected is not None:
        shown = re.sub(rf"\b{README_PORT}\b", port, block.expected.code)
        where = f"README.md:{block.expected.line}"
        assert _matches_in_order(shown, actual), f"{where} shows output this block does not print\n{report}"


def _serve_and_check(block: Block, work: Path, env: dict[str, str]) -> None:
    """Start the server block on a free port, run its client against it, stop it with SIGINT."""
    assert block.client is not None
    log = work / "server.log"
    code = re.sub(rf"\b{README_PORT}\b", "0", block.code)
    with open(log, "w") as out:
        server = subprocess.Popen(
            _command(block, work, code), cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,  # its own group: SIGINT reaches bash and the server
        )  # fmt: skip
    try:
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        listening = None
        while listening is None and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            listening = re.search(r"listening on http://[^:/\s]+:(\d+)", log.read_text())
        assert listening is not None, _report(block, server.poll(), log.read_text(), "(merged into stdout)")
        port = listening.group(1)
        _check(block.client, work, env, port)
    finally:
        stopped = _stop_with_ctrl_c(server)
    report = _report(block, server.returncode, log.read_text(), "(merged into stdout)")
    assert stopped, f"the server did not stop within 30 s of Ctrl-C\n{report}"
    _check_output(block, log.read_text().splitlines(), report, port)


def _stop_with_ctrl_c(server: subprocess.Popen) -> bool:
    """SIGINT to the server's process group; True when it then exits by itself."""
    if server.poll() is not None:
        return True
    os.killpg(server.pid, signal.SIGINT)
    try:
        server.wait(timeout=30)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        return False


@pytest.mark.parametrize("block", _run_blocks())
def test_readme_block_runs_as_written(block: Block, tmp_path: Path):
    work = tmp_path / "work"
    work.mkdir()
    env = _env(_shim_dir(tmp_path))
    if block.marker == "server":
        _serve_and_check(block, work, env)
    else:
        _check(block, work, env)
