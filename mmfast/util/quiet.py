"""Library noise filtered where it is written: native libraries' harmless warnings on the process's stderr.

DALI decodes PNGs through nvImageCodec's OpenCV extension, whose statically linked libpng prints a line such
as ``libpng warning: sRGB: out of place`` (or ``iCCP: known incorrect sRGB profile``) to file descriptor 2 for
every decode of a PNG whose colour-profile chunk is misplaced or non-standard: common in scraped and emoji
sets, harmless (the image decodes as usual), and printed again each epoch. libpng's handler is compiled in,
so the only place to filter is the descriptor itself: ``filter_native_stderr`` points fd 2 at a pipe read by
a small child process that drops those lines, forwards everything else at once and, at the end, says in one
line how many it hid. A child rather than a thread: when the run crashes, what it wrote last (an abort
message, a fatal-error dump) is still in the pipe and the child still forwards it. The process's helpers
(multiprocessing's fork server and resource tracker) inherit fd 2 and hold the pipe until the process exits,
so its end cannot tell the child the block is over: a byte on a control pipe does, and the child's exit does
not keep the process waiting (a grandchild forwards what the helpers write later).

Python's own ``sys.stderr`` keeps writing to the real stderr (progress bars still see a terminal).
``MMFAST_RAW_STDERR=1`` turns the filter off.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

# The child: drop harmless libpng colour-profile warnings, forward every other byte as soon as it is read. When
# the process is done (a byte, or the end, on the control pipe, argv[1]) it drains what is in the pipe, sums up,
# and exits; a grandchild forwards what the process's helpers (multiprocessing's fork server and resource
# tracker, which inherited fd 2) write until they end with it.
_FILTER = r"""
import os, re, select, sys
harmless = re.compile(rb"^libpng warning: .*(sRGB|iCCP|cHRM|gAMA|sBIT|profile)")
control = int(sys.argv[1])
hidden, tail = 0, b""

def forward(chunk):
    global hidden, tail
    *lines, tail = (tail + chunk).split(b"\n")
    out = []
    for line in lines:
        if harmless.match(line):
            hidden += 1
        else:
            out.append(line + b"\n")
    if tail and not (b"libpng warning:".startswith(tail) or tail.startswith(b"libpng warning:")):
        out.append(tail)  # a partial line that cannot be a libpng warning: no need to wait for its end
        tail = b""
    if out:
        os.write(1, b"".join(out))

def end():
    global hidden, tail
    if tail and not harmless.match(tail):
        os.write(1, tail)
    if hidden:
        os.write(1, (
            f"note: {hidden} libpng warnings about PNG colour-profile chunks (sRGB/iCCP) were hidden: harmless, "
            "the images decode as usual (MMFAST_RAW_STDERR=1 shows them)\n"
        ).encode())
    hidden, tail = 0, b""

watching = [0, control]
while True:
    if control in select.select(watching, [], [])[0]:
        os.set_blocking(0, False)
        try:
            while chunk := os.read(0, 65536):
                forward(chunk)
        except BlockingIOError:
            chunk = True  # the pipe is drained, not ended: helpers still hold it
        end()
        if not chunk or os.fork():
            os._exit(0)
        os.set_blocking(0, True)
        watching = [0]
        continue
    chunk = os.read(0, 65536)
    if not chunk:
        break
    forward(chunk)
end()
"""


@contextlib.contextmanager
def filter_native_stderr() -> Iterator[None]:
    """Within the block, file descriptor 2 drops libpng's harmless colour-profile warnings (see the module
    docstring); everything else reaches stderr unchanged. A no-op with ``MMFAST_RAW_STDERR=1`` or where fd 2
    cannot be redirected."""
    if os.environ.get("MMFAST_RAW_STDERR") == "1":
        yield
        return
    redirect = _Redirect()
    try:
        redirect.start()
    except OSError:
        redirect.stop()  # whatever part was set up is undone: plain stderr
    except BaseException:  # a Ctrl-C during the set-up: stderr as it was, then the interrupt
        redirect.stop()
        raise
    try:
        yield
    finally:
        redirect.stop()


class _Redirect:
    """fd 2 -> a pipe -> the filter child -> the original stderr; ``stop`` undoes whatever ``start`` did."""

    def __init__(self):
        self.saved: int | None = None
        self.control: int | None = None  # the write end of the child's control pipe: a byte there ends it
        self.child: subprocess.Popen | None = None
        self.redirected = False
        self.python_stderr = None

    def start(self) -> None:
        sys.stderr.flush()
        self.saved = os.dup(2)
        read_end, write_end = os.pipe()
        control_end, self.control = os.pipe()
        try:
            self.child = subprocess.Popen(
                [sys.executable, "-S", "-c", _FILTER, str(control_end)],
                stdin=read_end,
                stdout=self.saved,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                pass_fds=(control_end,),
                start_new_session=True,  # a Ctrl-C to the terminal's process group must not stop the filter
            )
        finally:
            os.close(read_end)
            os.close(control_end)
        try:
            os.dup2(write_end, 2)
            self.redirected = True
        finally:
            os.close(write_end)  # from here on fd 2 is the pipe's only write end in this process
        if sys.stderr is sys.__stderr__ and sys.stderr is not None:
            # Python's writes go straight to the real stderr: a progress bar still sees a terminal, and a
            # Python traceback never waits in the pipe.
            py = sys.stderr
            sys.stderr = os.fdopen(os.dup(self.saved), "w", buffering=1, encoding=py.encoding, errors="replace")
            self.python_stderr = py

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        if self.redirected:
            os.dup2(self.saved, 2)  # closes the pipe's last write end here: the child reads EOF
            self.redirected = False
        if self.python_stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.close()
            sys.stderr, self.python_stderr = self.python_stderr, None
        if self.control is not None:
            with contextlib.suppress(OSError):  # a child that is gone already
                os.write(self.control, b"e")  # fd 2 is restored: what the process wrote is in the pipe
            os.close(self.control)
            self.control = None
        if self.child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.child.wait(timeout=5)  # it drains the pipe and sums up; its grandchild forwards the rest
            self.child = None
        if self.saved is not None:
            os.close(self.saved)
            self.saved = None
