"""ps-launch's console: the chosen roles' output copied live to stdout, prefixed, and the launcher's messages.

Roles write only to their log files (so a slow or dead console never blocks
them); :class:`RoleOutput` follows a log as it grows, :class:`LineSplitter`
turns its text into lines as a terminal would show them ('\\r' progress updates
included), and :class:`Console` writes ``[trainer0] ...`` lines, keeping a
progress bar on one status line on a terminal and throttling it elsewhere.
"""

from __future__ import annotations

import codecs
import logging
import re
import shutil
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, TextIO, Tuple

from transpiler.roles.role_env import TRAINER

from .role import Role

PROGRESS_EVERY = 5.0  # s between two progress lines of one role when stdout is not a terminal
MAX_LINE = 64 * 1024  # a "line" this long without a newline is written out as it is
_SEPARATOR = re.compile(r"(\r\n|\r|\n)")


class LineSplitter:
    """Text in, lines out, as a terminal shows them: '\\n' ends a line, a lone '\\r' starts it over.

    ``feed`` returns the completed lines; ``status`` is the text a '\\r'
    update (a progress bar) left on the current line ('' if none, or cleared
    with blanks). Other lines leave it; a line that ends the bar's line replaces it, unless it only
    adds text after the bar as the last chunk showed it: then that text is the
    line and the bar stays. A '\\r' at the end of a chunk waits for the next
    one, which may make it a '\\r\\n'.
    """

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self.status = ""
        self._current, self._after_cr, self._pending_cr = "", False, False

    def feed(self, text: str) -> List[str]:
        """The lines ``text`` completes (without their newline); updates ``status``."""
        if self._pending_cr:
            text = "\r" + text
        self._pending_cr = text.endswith("\r")
        if self._pending_cr:
            text = text[:-1]
        lines = []
        parts = _SEPARATOR.split(text)
        for i in range(0, len(parts), 2):
            self._current += parts[i]
            sep = parts[i + 1] if i + 1 < len(parts) else None
            if sep is None:
                break
            if sep == "\r":
                self.status = (
                    self._current if self._current.strip() else ("" if self._current else self.status)
                )
                self._current, self._after_cr = "", True
            elif (
                self._after_cr
                and self.status
                and self._current != self.status
                and self._current.startswith(self.status)
            ):
                # Text written after a progress bar, on the bar's line (a log message while tqdm
                # runs): a line of its own, and the bar stays, as tqdm.write would have it.
                lines.append(self._current[len(self.status) :])
                self._current, self._after_cr = "", False
            else:
                lines.append(self._current)
                if self._after_cr:
                    self.status = ""  # the bar's own line ended ('\r...\n'): it is a line now
                self._current, self._after_cr = "", False
        if self._after_cr and self._current:
            self.status = self._current if self._current.strip() else ""
        elif len(self._current) >= self.max_line:
            lines.append(self._current)
            self._current = ""
        return lines

    def finish(self) -> List[str]:
        """The end of the stream: the unfinished line, or the last progress state, as a final line."""
        last = self._current if self._current.strip() and not self._after_cr else self.status
        self.status, self._current, self._after_cr, self._pending_cr = "", "", False, False
        return [last] if last.strip() else []


class _Guarded:
    """A stream whose failures are swallowed: the job must not die because its console went away
    (``ps-launch ... | head`` closes the pipe); after the first failure the stream is left alone."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.broken = stream, False

    def write(self, text: str) -> None:
        self._do(self.stream.write, text)

    def flush(self) -> None:
        self._do(self.stream.flush)

    def _do(self, call, *args) -> None:
        if self.broken:
            return
        try:
            call(*args)
        except (OSError, ValueError):  # BrokenPipeError, a full disk, a closed file
            self.broken = True


class Console:
    """Writes launcher messages and prefixed role output to ``out``/``err``.

    On a terminal (``tty``) the latest progress state of any shown role stays on
    one status line below the other output, redrawn in place. Elsewhere (a pipe,
    a file) a role's progress becomes an ordinary prefixed line at most every
    ``progress_every`` s, so logs of the console stay readable.
    """

    def __init__(
        self,
        out: Optional[TextIO] = None,
        err: Optional[TextIO] = None,
        tty: Optional[bool] = None,
        progress_every: float = PROGRESS_EVERY,
        clock: Callable[[], float] = time.monotonic,
        width: Optional[int] = None,
    ) -> None:
        out, err = out or sys.stdout, err or sys.stderr
        self.tty = out.isatty() if tty is None else tty
        self.out, self.err = _Guarded(out), _Guarded(err)
        self.progress_every, self.clock = progress_every, clock
        self.width = width or shutil.get_terminal_size((120, 24)).columns
        self._status = ""  # tty: the status line now on screen
        self._pending: Dict[str, str] = {}  # not tty: the progress not yet written, by tag
        self._reported: Dict[str, str] = {}  # the last progress state each role reported
        self._last_progress: Dict[str, float] = {}

    def _clear(self) -> None:
        if self._status:
            self.out.write("\r\x1b[K")

    def _redraw(self) -> None:
        if self._status:
            self.out.write(self._status)
        self.out.flush()

    def launcher(self, text: str, error: bool = False) -> None:
        """A message of the launcher itself (stderr when ``error``), whole lines as given."""
        if self.tty:
            self._clear()
            self.out.flush()
        stream = self.err if error else self.out
        stream.write(text + "\n")
        stream.flush()
        if self.tty:
            self._redraw()

    def role_lines(self, tag: str, lines: Sequence[str]) -> None:
        """Completed lines of a role, each as ``[tag] line``; they supersede its progress state."""
        if not lines:
            return
        self._pending.pop(tag, None)
        if self.tty:
            self._clear()
        self.out.write("".join(f"[{tag}] {line}".rstrip() + "\n" for line in lines))
        if self.tty:
            self._redraw()
        else:
            self.out.flush()

    def role_status(self, tag: str, status: str) -> None:
        """A role's progress state (what its '\\r' updates show now; '' if none)."""
        if self._reported.get(tag, "") == status:
            return
        self._reported[tag] = status
        if not status:
            if self.tty and self._status.startswith(f"[{tag}] "):
                self._clear()
                self._status = ""
                self.out.flush()
            self._pending.pop(tag, None)
            return
        shown = f"[{tag}] {status}".rstrip()
        if self.tty:
            shown = shown[: max(self.width - 1, 20)]  # a wrapped status line could not be redrawn in place
            if shown != self._status:
                self._clear()
                self._status = shown
                self._redraw()
            return
        self._pending[tag] = shown
        self.flush_progress()

    def flush_progress(self, force: bool = False) -> None:
        """Not tty: write each role's pending progress line once its last is ``progress_every`` s old."""
        now = self.clock()
        for tag, shown in list(self._pending.items()):
            if force or now - self._last_progress.get(tag, float("-inf")) >= self.progress_every:
                self.out.write(shown + "\n")
                self._last_progress[tag] = now
                del self._pending[tag]
        self.out.flush()

    def close(self) -> None:
        """Leave the terminal on a fresh line (the status line stays, as the last state)."""
        if self.tty and self._status:
            self.out.write("\n")
            self._status = ""
        self.out.flush()


class RoleOutput:
    """Follows one role's log file and copies what it gains to the console, prefixed with the role's tag."""

    def __init__(self, role: Role, console: Console) -> None:
        self.role, self.console = role, console
        self.splitter = LineSplitter()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._file = None
        self._finished_pid: Optional[int] = None

    def pump(self) -> None:
        """Copy what the log gained; once the process has ended, its last unfinished line too."""
        proc = self.role.proc
        if proc is None:
            return
        ended = proc.poll() is not None  # before reading: all it wrote is in the file by then
        if self._file is None:
            try:
                self._file = open(self.role.log_path, "rb")
            except (OSError, TypeError):
                return
        try:
            data = self._file.read()
        except OSError:
            return  # the log is the record; the console copy is a convenience
        if data:
            self._emit(self.splitter.feed(self._decoder.decode(data)))
        if ended and self._finished_pid != proc.pid:
            self._finished_pid = proc.pid  # a restarted process (new pid) gets its own end
            self._emit(self.splitter.feed(self._decoder.decode(b"", final=True)) + self.splitter.finish())

    def _emit(self, lines: List[str]) -> None:
        self.console.role_lines(self.role.tag, lines)
        self.console.role_status(self.role.tag, self.splitter.status)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class ConsoleHandler(logging.Handler):
    """Sends the launcher's log records to the console: INFO and below on stdout, WARNING and up on stderr."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console
        self.setFormatter(logging.Formatter("ps-launch: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.launcher(self.format(record), error=record.levelno >= logging.WARNING)
        except Exception:  # noqa: BLE001  logging must never take the launcher down
            self.handleError(record)


def shown_roles(roles: Sequence[Role], show: Optional[Tuple[str, ...]]) -> List[Role]:
    """The roles whose output goes to the console, for ``--show`` items (args.show_spec).

    None (no ``--show``): trainer 0 (its local rank 0), or on a host without it this
    host's first trainer, or nobody. ``trainers``/``pservers`` pick a kind; a tag
    (``trainer0``, ``pserver1``, ``trainer0.1``) picks a role if it runs on this host.
    """
    if show is None:
        leaders = sorted((r for r in roles if r.kind == TRAINER and r.local_rank == 0), key=lambda r: r.index)
        return leaders[:1]
    if "all" in show:
        return list(roles)
    return [r for r in roles if r.tag in show or f"{r.kind.lower()}s" in show]


class ConsoleCopier:
    """The followers of every shown role; ``pump`` copies what is new, ``drain`` everything to the end."""

    def __init__(self, console: Console, roles: Sequence[Role]) -> None:
        self.console = console
        self.outputs = [RoleOutput(r, console) for r in roles]

    def pump(self) -> None:
        """Copy every shown role's new output (called from the supervisor's poll loop)."""
        for output in self.outputs:
            output.pump()
        if not self.console.tty:
            self.console.flush_progress()

    def drain(self) -> None:
        """Copy everything left (roles ended), write pending progress lines, and close the files."""
        self.pump()
        if not self.console.tty:
            self.console.flush_progress(force=True)
        for output in self.outputs:
            output.close()
