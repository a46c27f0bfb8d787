"""Runs the code blocks of a documentation page (README.md, docs/guides/*.md) as tests/docs/test_docs.py asks.

Sybil parses the page: every ```bash and ```python block is an example, and ``<!-- skip: next "reason" -->``
skips the block after it. The blocks of one page run in order in one fresh working directory filled with
the fixture data (``fill_workdir``); bash blocks each in ``bash -euo pipefail``, python blocks in one
interpreter per page (tests/docs_kernel.py), so they share one namespace. Every block is bounded in time:
one that runs past it is killed and fails, naming its line."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from unittest import SkipTest

from sybil.document import Document
from sybil.parsers.markdown import CodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parents[1]
KERNEL = Path(__file__).with_name("docs_kernel.py")
BLOCK_TIMEOUT_S = 240  # one block; the pages' examples are meant to take seconds
TAIL_CHARS = 4000  # of a failing block's output, shown in the failure
# A page whose blocks name one of these trains a model: it runs in the slow lane (--run-slow).
TRAINS = re.compile(
    r"mmfast-train|mmfast-profile|accelerate launch|torchrun|mmfast\.train\b|tools/train\.py|open_clip_data"
    r"|optimizer\.step"
)


def fill_workdir(workdir: Path, data: Path) -> None:
    """Copy the fixture data (``tools/datasets/docs_examples.py``'s folder) into a page's fresh working
    directory."""
    shutil.copytree(data, workdir, dirs_exist_ok=True)


def page_env(cache: Path) -> dict[str, str]:
    """The environment of a page's blocks: the venv's installed commands first on PATH, this checkout's
    mmfast imported, offline, and mmfast's cache (the demo set) in ``cache``."""
    venv_bin = str(Path(sys.executable).parent)
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": python_path,
        "MMFAST_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


@dataclass
class PageRun:
    """One page's blocks in progress: its working directory, environment, and python interpreter."""

    workdir: Path
    env: dict[str, str]
    timeout_s: float = BLOCK_TIMEOUT_S
    ran: list[int] = field(default_factory=list)  # lines of the blocks that ran
    seconds: dict[int, float] = field(default_factory=dict)  # each block's wall time, by line
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line, reason)
    _kernel: subprocess.Popen | None = None
    _results: int | None = None
    _log: Path | None = None

    def bash(self, source: str, line: int) -> str | None:
        """Run a bash block; None when it exits 0, else what went wrong with its output's tail."""
        log = self.workdir.parent / f"{self.workdir.name}.bash-{line}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", source],
                cwd=self.workdir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return f"ran past {self.timeout_s:.0f} s and was killed; its output ended:\n{_tail(log)}"
        self.ran.append(line)
        return None if rc == 0 else f"bash exited {rc}; its output ended:\n{_tail(log)}"

    def python(self, source: str, path: str, line: int) -> str | None:
        """Run a python block in the page's interpreter; None when it raises nothing, else its traceback."""
        if self._kernel is None:
            self._start_kernel()
        request = {"source": str(source), "path": path, "line": line}
        self._kernel.stdin.write((json.dumps(request) + "\n").encode())
        self._kernel.stdin.flush()
        reply = self._read_reply()
        if reply is None:
            self.close()
            why = f"ran past {self.timeout_s:.0f} s or its interpreter died"
            return f"{why}; its output ended:\n{_tail(self._log)}"
        self.ran.append(line)
        return None if reply["ok"] else f"{reply['error']}\nits output ended:\n{_tail(self._log)}"

    def _start_kernel(self) -> None:
        read_fd, write_fd = os.pipe()
        self._log = self.workdir.parent / f"{self.workdir.name}.python.log"
        with open(self._log, "wb") as out:
            self._kernel = subprocess.Popen(
                [sys.executable, str(KERNEL), str(write_fd)],
                cwd=self.workdir,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        os.close(write_fd)
        self._results = read_fd

    def _read_reply(self) -> dict | None:
        """The kernel's one-line JSON reply, or None after the block's time (or when the kernel died)."""
        data = b""
        while not data.endswith(b"\n"):
            ready, _, _ = select.select([self._results], [], [], self.timeout_s)
            chunk = os.read(self._results, 65536) if ready else b""
            if not chunk:
                return None
            data += chunk
        return json.loads(data)

    def close(self) -> None:
        """End the page's interpreter (and anything it started)."""
        if self._kernel is not None:
            _kill_group(self._kernel)
            self._kernel.stdin.close()
            os.close(self._results)
            self._kernel = None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _tail(log: Path | None) -> str:
    if log is None or not log.exists():
        return ""
    return log.read_bytes()[-TAIL_CHARS:].decode("utf-8", errors="replace")


def _bash(example) -> str | None:
    return example.namespace["_page"].bash(example.parsed, example.line)


def _python(example) -> str | None:
    return example.namespace["_page"].python(example.parsed, example.path, example.line)


def parse_page(path: Path) -> Document:
    """The page as Sybil reads it: its bash and python blocks, and its skip directives."""
    parsers = (CodeBlockParser("bash", _bash), CodeBlockParser("python", _python), SkipParser())
    return Document.parse(str(path), *parsers)


def trains(path: Path) -> bool:
    """Whether a block of the page trains a model (the page then belongs to the slow lane)."""
    blocks = [ex for ex in parse_page(path).examples() if ex.region.evaluator in (_bash, _python)]
    return any(TRAINS.search(str(ex.parsed)) for ex in blocks)


def run_page(
    path: Path, workdir: Path, data: Path, env: dict[str, str], timeout_s: float = BLOCK_TIMEOUT_S
) -> PageRun:
    """Run every block of the page at ``path`` in order, in ``workdir`` filled with ``data``.

    Returns:
        the run: which blocks ran, which were skipped and why.

    Raises:
        sybil.example.SybilFailure: the first block that fails, with its line and output.
    """
    workdir.mkdir(parents=True)
    fill_workdir(workdir, data)
    page = PageRun(workdir, env, timeout_s)
    document = parse_page(path)
    document.namespace["_page"] = page
    try:
        for example in document.examples():
            start = time.monotonic()
            try:
                example.evaluate()
            except SkipTest as e:
                page.skipped.append((example.line, str(e)))
            if example.line in page.ran:  # a block, not a skip directive
                page.seconds[example.line] = round(time.monotonic() - start, 1)
    finally:
        page.close()
    return page
