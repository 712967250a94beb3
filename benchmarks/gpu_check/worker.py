"""What every stage worker of the GPU check shares: its command line, the device, its children, its result.

A stage worker is ``python -m benchmarks.gpu_check.<stage>_stage --device cuda --result FILE``:
it runs one stage and writes ``{"ok": bool, "figures": {...}, "note": str}`` to FILE, which the
check reads (its own deadline kills the worker and every process it started). ``--plan`` prints
what the stage would run, as JSON, and runs nothing: the dry run's view of the stage.

Processes a stage starts (trainers, pservers) are spawned (``multiprocessing``'s "spawn": CUDA
cannot be forked), each with a deadline; a child's result comes back through a file, and its error
(the traceback) through another, so the stage can say which child failed and why.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import shutil
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from benchmarks.common.paths import DEFAULT_PEERS, REPO, peer_module

log = logging.getLogger("gpu_check")

# The peers' jobs.py when ../shared/peers is not beside the repository (a GPU machine carries only the
# repository): `python -m benchmarks.gpu_check --fetch-wheels` copies it here, into the carried folder.
CARRIED_PEERS = os.path.join(REPO, ".whl", "peers")
# The CPU tests' tolerance for "trainers on GPUs equal one process on the concatenated batches".
RTOL, ATOL = 1e-4, 1e-5

# A stage's answer: (passed, figures, note).
Outcome = Tuple[bool, Dict[str, object], str]


def parser(description: str) -> argparse.ArgumentParser:
    """The command line every stage worker takes."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda: the stage as the check runs it; cpu: the same code on the CPU (gloo for NCCL)",
    )
    p.add_argument("--quick", action="store_true", help="smaller sizes (the CPU simulation's)")
    p.add_argument("--result", help="write the stage's result (JSON) here")
    p.add_argument("--plan", action="store_true", help="print what the stage would run (JSON) and exit")
    return p


def device_of(name: str) -> torch.device:
    """``cuda:0`` (the one GPU every process of the check shares) or the CPU; TF32 off either way.

    TF32 rounds float32 matmuls to 10 mantissa bits: with it the GPU could not match the CPU
    tests' tolerances, and the comparison would measure TF32 instead of the distributed path.
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch sees no GPU (torch.cuda.is_available() is False)")
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def tf32_off() -> bool:
    """Whether TF32 is off for matmuls and cuDNN in this process (a figure of every comparing stage)."""
    return not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


class PeersMissing(FileNotFoundError):
    """The peers' ``jobs.py`` is in neither place: jobs D and S cannot be defined here."""


def peers_dir() -> str:
    """The folder of the peers' ``jobs.py``: ``../shared/peers``, else the copy carried in ``.whl/peers``."""
    for folder in (DEFAULT_PEERS, CARRIED_PEERS):
        if os.path.isfile(os.path.join(folder, "jobs.py")):
            return folder
    raise PeersMissing(
        f"no jobs.py in {DEFAULT_PEERS} nor {CARRIED_PEERS}: run `python -m benchmarks.gpu_check "
        f"--fetch-wheels` where ../shared/peers exists, and carry .whl"
    )


def jobs_module():
    """The peers' ``jobs.py`` (job D and job S: their models' sizes, data and AUC)."""
    return peer_module(peers_dir(), "jobs")


def first_line(e: BaseException) -> str:
    """``Type: the first line of its message``: an error short enough for the table."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def finite(values: Sequence[float]) -> bool:
    """Whether every value is a finite number (and there is at least one)."""
    return bool(values) and all(math.isfinite(v) for v in values)


def compare_states(
    got: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    rtol: float = RTOL,
    atol: float = ATOL,
) -> Tuple[bool, float, str]:
    """(every tensor within tolerance, the largest |difference|, the first key outside or "")."""
    if set(got) != set(expected):
        return False, math.inf, f"keys differ: {sorted(set(got) ^ set(expected))}"
    worst, bad = 0.0, ""
    for k in sorted(expected):
        a, b = got[k].detach().cpu().double(), expected[k].detach().cpu().double()
        if a.shape != b.shape:
            return False, math.inf, f"{k}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        worst = max(worst, diff)
        if not bad and not torch.allclose(a, b, rtol=rtol, atol=atol):
            bad = k
    return not bad, worst, bad


# -- children -------------------------------------------------------------------


def _child(fn: Callable, out: str, args: tuple) -> None:
    """A spawned child: ``fn(*args)`` saved to ``out``; an error's traceback to ``out + ".error"``."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = fn(*args)
    except BaseException:
        with open(out + ".error", "w") as f:
            f.write(traceback.format_exc())
        raise
    torch.save(result, out)


class Children:
    """Processes of one stage (trainers, pservers), spawned; stopped on leaving the ``with`` block.

    ``start(fn, args)`` runs ``fn(*args)`` in a new process; ``wait(procs, timeout)`` returns
    their results (what ``fn`` returned) or raises naming the child that failed or overran.
    """

    def __init__(self, what: str):
        self.what = what
        self.ctx = multiprocessing.get_context("spawn")
        self.dir = tempfile.mkdtemp(prefix="gpu_check-")
        self.procs: List[Tuple[multiprocessing.Process, str, str]] = []

    def __enter__(self) -> "Children":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, name: str, fn: Callable, args: tuple) -> int:
        """Start ``fn(*args)`` as child ``name``; its index for :meth:`wait`."""
        out = os.path.join(self.dir, f"{len(self.procs)}-{name}.pt")
        p = self.ctx.Process(target=_child, args=(fn, out, args), name=name)
        p.start()
        self.procs.append((p, out, name))
        return len(self.procs) - 1

    def wait(self, indices: Sequence[int], timeout: float) -> List[object]:
        """The results of children ``indices``, once all exited 0 within ``timeout`` s in all."""
        deadline = time.monotonic() + timeout
        for i in indices:
            p, _, _ = self.procs[i]
            while p.is_alive() and time.monotonic() < deadline:
                p.join(0.2)
                failed = [j for j in indices if self.procs[j][0].exitcode not in (None, 0)]
                if failed:  # one child failed: the others may wait for it forever (a barrier)
                    self._raise(failed[0])
        late = [self.procs[i][2] for i in indices if self.procs[i][0].is_alive()]
        if late:
            raise TimeoutError(f"{self.what}: {', '.join(late)} still running after {timeout:.0f} s")
        for i in indices:
            if self.procs[i][0].exitcode != 0:
                self._raise(i)
        return [torch.load(self.procs[i][1], weights_only=False) for i in indices]

    def _raise(self, i: int) -> None:
        p, out, name = self.procs[i]
        try:
            with open(out + ".error") as f:
                error = f.read().strip().splitlines()
        except OSError:
            error = [f"no traceback (exit code {p.exitcode})"]
        raise RuntimeError(
            f"{self.what}: {name} failed: {error[-1] if error else '?'}\n" + "\n".join(error[-12:])
        )

    def stop(self) -> None:
        """Kill every child still running, reap it, and remove the children's result files."""
        for p, _, _ in self.procs:
            if p.is_alive():
                p.kill()
        for p, _, _ in self.procs:
            p.join(5)
        shutil.rmtree(self.dir, ignore_errors=True)


# -- the worker's main ------------------------------------------------------------


def run_worker(
    argv: Optional[Sequence[str]],
    description: str,
    run: Callable[[argparse.Namespace], Outcome],
    plan: Callable[[str, bool], Dict[str, object]],
) -> int:
    """Parse the worker's command line; print the plan, or run the stage and write its result.

    Exit status 0 when the stage passed, 1 when it failed (its result file says why).
    """
    args = parser(description).parse_args(argv)
    if args.plan:
        print(json.dumps(plan(args.device, args.quick), default=str))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()
    try:
        ok, figures, note = run(args)
    except Exception as e:  # the stage failed: its result says how, the next stage still runs
        log.exception("the stage failed")
        ok, figures, note = False, {}, first_line(e)
    result = {"ok": bool(ok), "figures": figures, "note": note, "seconds": round(time.monotonic() - t0, 2)}
    line = json.dumps(result, default=str)
    print("STAGE_RESULT " + line, flush=True)
    if args.result:
        tmp = args.result + ".tmp"
        with open(tmp, "w") as f:
            f.write(line)
        os.replace(tmp, args.result)
    return 0 if ok else 1
