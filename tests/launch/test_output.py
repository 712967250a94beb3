"""ps-launch's console, the pure pieces: lines as a terminal shows them, prefixing, progress, --show."""

from __future__ import annotations

import io

import pytest

from tests.helpers import paths
from trainer.launch import plan as launch_plan
from trainer.launch.console import Console, LineSplitter, shown_roles

REPO = paths.REPO
PROBE = str(REPO / "tests" / "scripts" / "role_probe.py")
BAR1, BAR2 = "train:  10%|#    | 1/10", "train:  20%|##   | 2/10"

# chunks fed in order -> (lines completed, status after the last chunk, lines finish() adds)
SPLITS = [
    (["a\nb\n"], ["a", "b"], "", []),
    (["par", "tial\n"], ["partial"], "", []),
    (["no newline at the end"], [], "", ["no newline at the end"]),
    (["dos\r\nline\r\n"], ["dos", "line"], "", []),
    (["dos\r", "\nsplit across chunks\r", "\n"], ["dos", "split across chunks"], "", []),
    # tqdm: '\r' then the state; the last state is the status; close writes '\n'
    ([f"\r{BAR1}", f"\r{BAR2}"], [], BAR2, [BAR2]),
    ([f"\r{BAR1}", f"\r{BAR2}\n"], [BAR2], "", []),
    ([f"\r{BAR1}\r{BAR2}\rtrain: 100%\n"], ["train: 100%"], "", []),
    # a state followed by '\r' is the status once the next chunk shows the '\r' is no '\r\n'
    ([f"{BAR1}\r"], [], "", [BAR1]),
    ([f"{BAR1}\r", f"{BAR2}\r", "x"], [], "x", ["x"]),
    ([f"{BAR1}\r", f"{BAR2}\r", "log\n"], ["log"], "", []),  # a line over the bar's line ends it
    # tqdm(leave=False) blanks its line: no status, nothing left
    ([f"\r{BAR1}", "\r          \r"], [], "", []),
    # a log line written on the bar's line (the bar as the last chunk showed it): its own line, bar stays
    ([f"\r{BAR1}", "INFO: step 10\n", "RESULT {}\n"], ["INFO: step 10", "RESULT {}"], BAR1, [BAR1]),
    # ... and then the bar's final state
    ([f"\r{BAR1}", "INFO: x\n", f"\r{BAR2}\n"], ["INFO: x", BAR2], "", []),
    # in one chunk there is no telling: the terminal's view, the bar and the text on one line
    ([f"\r{BAR1}INFO: y\n"], [f"{BAR1}INFO: y"], "", []),
    # ordinary lines between bar states leave the bar as it was
    ([f"\r{BAR1}\n", "log\n"], [BAR1, "log"], "", []),
    (["", "\n\n"], ["", ""], "", []),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("chunks, lines, status, finished", SPLITS, ids=[repr(s[0])[:40] for s in SPLITS])
def test_line_splitter(chunks, lines, status, finished):
    s = LineSplitter()
    got = [line for chunk in chunks for line in s.feed(chunk)]
    assert (got, s.status) == (lines, status)
    assert s.finish() == finished
    assert s.status == "" and s.feed("next\n") == ["next"]


@pytest.mark.timeout(10)
def test_over_long_partial_line_is_written_out():
    s = LineSplitter(max_line=10)
    assert s.feed("0123456789abc") == ["0123456789abc"]
    assert s.feed("d\n") == ["d"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.timeout(10)
def test_console_off_a_terminal_prefixes_and_throttles_progress():
    out, err, clock = io.StringIO(), io.StringIO(), Clock()
    c = Console(out, err, tty=False, progress_every=5.0, clock=clock)
    c.role_lines("trainer0", ["hello", "  indented  "])
    c.role_status("trainer0", BAR1)  # the first progress state is written at once
    clock.now += 1
    c.role_status("trainer0", BAR2)  # 1 s later: held back
    c.role_status("pserver1", "other bar")  # another role has its own clock
    clock.now += 4
    c.flush_progress()  # 5 s after the first: the latest state
    c.role_status("trainer0", "train: 30%")
    c.role_lines("trainer0", ["a line supersedes the pending state"])
    c.role_status("trainer0", "train: 40%")
    c.flush_progress(force=True)
    c.launcher("ps-launch: done")
    c.launcher("ps-launch: warning: oops", error=True)
    assert out.getvalue().splitlines() == [
        "[trainer0] hello",
        "[trainer0]   indented",
        f"[trainer0] {BAR1}",
        "[pserver1] other bar",
        f"[trainer0] {BAR2}",
        "[trainer0] a line supersedes the pending state",
        "[trainer0] train: 40%",
        "ps-launch: done",
    ]
    assert err.getvalue() == "ps-launch: warning: oops\n"


@pytest.mark.timeout(10)
def test_console_on_a_terminal_keeps_progress_on_one_status_line():
    out, err = io.StringIO(), io.StringIO()
    c = Console(out, err, tty=True, width=40)
    c.role_status("trainer0", BAR1)
    c.role_status("trainer0", BAR1)  # unchanged: nothing written
    c.role_status("trainer0", BAR2)
    c.role_lines("trainer0", ["log"])  # above the status line, which is drawn again
    c.launcher("ps-launch: msg")
    c.role_status("trainer0", "x" * 100)  # cut to the terminal's width: a wrapped line cannot be redrawn
    c.role_status("trainer0", "")  # cleared
    c.role_status("trainer0", BAR1)
    c.close()  # the last state stays, on its own line
    clear = "\r\x1b[K"
    assert out.getvalue() == (
        f"[trainer0] {BAR1}"
        + clear
        + f"[trainer0] {BAR2}"
        + clear
        + "[trainer0] log\n"
        + f"[trainer0] {BAR2}"
        + clear
        + "ps-launch: msg\n"
        + f"[trainer0] {BAR2}"
        + clear
        + "[trainer0] "
        + "x" * 28
        + clear
        + f"[trainer0] {BAR1}"
        + "\n"
    )


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "argv, show, tags",
    [
        (["--server_num", "2", "--worker_num", "2"], None, ["trainer0"]),
        (["--server_num", "2", "--worker_num", "2", "--nproc_per_node", "2"], None, ["trainer0"]),
        (["--server_num", "2", "--worker_num", "2"], "all", ["pserver0", "pserver1", "trainer0", "trainer1"]),
        (["--server_num", "2", "--worker_num", "2"], "none", []),
        (["--server_num", "2", "--worker_num", "2"], "pservers", ["pserver0", "pserver1"]),
        (
            ["--server_num", "2", "--worker_num", "2", "--nproc_per_node", "2"],
            "trainers",
            ["trainer0", "trainer0.1", "trainer1", "trainer1.1"],
        ),
        (
            ["--server_num", "2", "--worker_num", "2", "--nproc_per_node", "2"],
            "trainer1.1,pserver0,trainer7",
            ["pserver0", "trainer1.1"],
        ),
        # per-host mode on a host without trainer 0: its first trainer
        (
            [
                "--servers",
                "127.0.0.1:7000,127.0.0.2:7000",
                "--workers",
                "127.0.0.2,127.0.0.1,127.0.0.1",
                "--host",
                "127.0.0.1",
            ],
            None,
            ["trainer1"],
        ),
        (["--servers", "127.0.0.1:7000", "--workers", "127.0.0.2", "--host", "127.0.0.1"], None, []),
    ],
)
def test_shown_roles(argv, show, tags):
    args = launch_plan.parse_args([*argv, *(["--show", show] if show else []), PROBE])
    roles = launch_plan.plan_roles(args, pick_ports=lambda n: [7100 + i for i in range(n)], environ={})
    assert [r.tag for r in shown_roles(roles, args.show)] == tags


class GoneAway(io.StringIO):
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("tty", [False, True])
def test_console_that_went_away_does_not_stop_the_job(tty):
    err = io.StringIO()
    c = Console(GoneAway(), err, tty=tty)  # ps-launch ... | head, once head has exited
    c.role_lines("trainer0", ["a"])
    c.role_status("trainer0", BAR1)
    c.launcher("ps-launch: still here")
    c.launcher("ps-launch: warning: and here", error=True)
    c.flush_progress(force=True)
    c.close()
    assert err.getvalue() == "ps-launch: warning: and here\n"
