"""A small sync/async job for the fault tests: one script, every role (Paddle role variables).

Trainers train with ``Trainer.batches`` so a roll-back replays their data.
``--pause_at N``: the trainer ``--pause_trainer`` writes PAUSE_DIR/reached when
it is about to train step N (once), then waits for PAUSE_DIR/go, so the test
can kill a role at a known point. ``--hold_push S``: trainer ``--hold_trainer`` sends its push of
step S to the first pserver, and once that one has applied it writes PAUSE_DIR/held and holds the
push to the second until PAUSE_DIR/release exists (a trainer whose step one pserver counted and
the other, which may drop it meanwhile, has not). ``--step_delay`` stretches each step until PAUSE_DIR/calm
exists: a test whose kills are done writes it, and the rest of the job runs at full speed (the
same steps and data). ``--pause_every_trainer``: every trainer pauses at step N, writing
PAUSE_DIR/reached-<id>, until PAUSE_DIR/go. ``--counting``: the model counts the pushes applied to it
(:func:`counting_loss`). ``--record_claims`` (backup trainers): each trainer appends to
OUT_DIR/claims-<id>.jsonl a line per step it went through, with its data position and every Claim answer
it got for it, and a last line with its final step (:func:`reference_of_steps` trains what they say in one
process; a killed trainer's lines stay, its restart appends). ``--hold_after_claim S``: trainer
``--pause_trainer``, at the first step from S on that its claim is admitted to, writes PAUSE_DIR/claimed
(the step) and holds there, pushing nothing, until killed (once: its restart does not). Each trainer
saves its final ``state_dict`` to OUT_DIR/trainer-<id>.pt and the one it started with to
OUT_DIR/start-<id>.pt. :func:`reference` trains the same job in one process (the concatenated batches).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program, RoleEnv

BATCH = 8
SAMPLES = 320  # 20 batches per trainer and epoch with 2 trainers
TRAINERS = 2
BARRIER_TIMEOUT = 60.0
TALLY = 1000  # --counting: trainer t's pushes count TALLY**t each


HIDDEN = 512
# --hidden WIDE: a model of 8.5 MB, so that each step's push to each of two pservers (4.2 MB) streams and
# splits across --push_lanes connections (a push of at most 4 MiB goes as one message).
WIDE = 57344

# --dtype float64: the job's model and data in float64. A test that compares the job's model with
# :func:`reference` runs it so: the job steps with the mean of per-trainer gradients, the reference with
# the gradient of the concatenated batch, and in float32 the two drift apart over the steps by an
# amount that depends on the CPU's kernels (1.2e-4 seen on the wide model over 240 steps on one CPU,
# 3e-5 on another). In float64 the drift is some 1e-9 of that: harness.models.FLOAT64_JOB.
DTYPES = {"float32": torch.float32, "float64": torch.float64}
FLOAT64 = ["--dtype", "float64"]


def build_model(hidden: int = HIDDEN, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The job's model; ``dtype`` converts the float32 initialisation, the same values in either."""
    torch.manual_seed(0)
    # 512 wide: a 16k-element weight, 2 blocks
    model = nn.Sequential(nn.Linear(32, hidden), nn.Tanh(), nn.Linear(hidden, 4))
    return model.to(dtype)


def build_program(
    optimizer: str = "momentum", lr: float = 0.05, hidden: int = HIDDEN, dtype: torch.dtype = torch.float32
) -> Program:
    kwargs = {"momentum": 0.9} if optimizer == "momentum" else {}
    return Program(build_model(hidden, dtype), optimizer, lr=lr, **kwargs)


def counting_program() -> Program:
    """``--counting``: the model with every parameter at 0, trained by plain SGD at lr 1 on
    :func:`counting_loss`. Each element then stands at minus (trainer 0's pushes applied to it +
    TALLY * trainer 1's), exactly (integers far below float32's 2**24)."""
    model = build_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return Program(model, "sgd", lr=1.0)


def counting_loss(model: nn.Module, trainer_id: int) -> torch.Tensor:
    """A loss whose gradient is TALLY**trainer_id on every element of every parameter."""
    return sum(p.sum() for p in model.parameters()) * float(TALLY**trainer_id)


def dataset(dtype: torch.dtype = torch.float32) -> TensorDataset:
    """The job's samples: drawn in float32 and converted, the same values and labels in either dtype."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 32, generator=g)
    y = (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4
    return TensorDataset(x.to(dtype), y)


def loss_of(model: nn.Module, x, y) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def reference(
    epochs: int,
    optimizer: str = "momentum",
    lr: float = 0.05,
    alone: Optional[Tuple[int, Dict[str, slice]]] = None,
    hidden: int = HIDDEN,
    trainers: Tuple[int, ...] = tuple(range(TRAINERS)),
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Single-process PyTorch on the trainers' concatenated batches: what sync training must equal.

    ``alone`` = (step, {param: rows}): at that step those rows are updated with trainer 0's
    gradient alone, as a pserver that dropped trainer 1 from that step applies it. ``trainers``:
    whose batches make each step (one backup trainer of two: one trainer's). ``dtype``: the job's
    ``--dtype``. Computed on one torch thread, as the job's processes compute: on a loaded 2-core
    machine two threads spinning for these small steps took 3x longer (15x seen).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        program = build_program(optimizer, lr, hidden, dtype)
        model, data = program.model, dataset(dtype)
        opt = program.optimizer.build(model.parameters())
        samplers = [DistributedSampler(data, TRAINERS, t, shuffle=True, seed=0) for t in range(TRAINERS)]
        for epoch in range(epochs):
            for s in samplers:
                s.set_epoch(epoch)
            orders = [list(s) for s in samplers]
            for b in range(len(orders[0]) // BATCH):
                idx = [i for t in trainers for i in orders[t][b * BATCH : (b + 1) * BATCH]]
                x, y = data[idx]
                opt.zero_grad()
                loss_of(model, x, y).backward()
                if alone is not None and alone[0] == epoch * (len(orders[0]) // BATCH) + b:
                    _keep_trainer0_gradient(model, data[orders[0][b * BATCH : (b + 1) * BATCH]], alone[1])
                opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def reference_of_steps(
    steps: Sequence[Sequence[Tuple[int, int, int]]], dtype: torch.dtype = torch.float64
) -> dict:
    """Single-process PyTorch fed, at each step, the batches ``steps[s]`` names ((trainer, epoch, batch) of
    each trainer that made step s): what a job with backup trainers must equal (its default program)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        program = build_program("momentum", 0.05, HIDDEN, dtype)
        model, data = program.model, dataset(dtype)
        opt = program.optimizer.build(model.parameters())
        orders: Dict[Tuple[int, int], List[int]] = {}
        for made in steps:
            idx = []
            for trainer, epoch, batch in made:
                if (trainer, epoch) not in orders:
                    sampler = DistributedSampler(data, TRAINERS, trainer, shuffle=True, seed=0)
                    sampler.set_epoch(epoch)
                    orders[trainer, epoch] = list(sampler)
                idx += orders[trainer, epoch][batch * BATCH : (batch + 1) * BATCH]
            x, y = data[idx]
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def record_claims(tr, hold_from: int = -1, pause_dir: str = "") -> Dict[int, list]:
    """--record_claims: every Claim answer ``tr`` gets from the first pserver, by step ({step: [(admitted,
    trainers), ...]}), retries after a failover included. ``hold_from`` >= 0 (--hold_after_claim): at the
    first step from there whose claim admits this trainer, write PAUSE_DIR/claimed and hold."""
    replies: Dict[int, list] = {}
    channel = tr.channels[tr.program.pservers[0]]
    claim = channel.claim

    def recorded(step):
        reply = claim(step)
        replies.setdefault(step, []).append((reply.admitted, list(reply.trainers)))
        held = os.path.join(pause_dir, "claimed")
        if 0 <= hold_from <= step and reply.admitted and not os.path.exists(held):  # once: not its restart
            with open(held + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(held + ".tmp", held)
            wait_for(os.path.join(pause_dir, "never"), 3600.0)  # killed here: the step's set dies with it
        return reply

    channel.claim = recorded
    return replies


def _keep_trainer0_gradient(model: nn.Module, batch0, rows: Dict[str, slice]) -> None:
    """Replace the gradient of ``rows`` ({param: rows}) with the one of trainer 0's batch alone."""
    params = dict(model.named_parameters())
    mixed = {name: p.grad.clone() for name, p in params.items()}
    model.zero_grad()
    loss_of(model, *batch0).backward()
    for name, p in params.items():
        if name in rows:
            mixed[name][rows[name]] = p.grad[rows[name]]
        p.grad = mixed[name]


def rows_on(program, endpoint: str) -> Dict[str, slice]:
    """{param: rows} of the blocks a trainer program places on ``endpoint``."""
    return {b.param: slice(b.row_start, b.row_end) for b in program.blocks if b.endpoint == endpoint}


def hold_push(tr, step: int, pause_dir: str) -> None:
    """Hold ``tr``'s push of ``step`` to its second pserver until the first applied it and
    PAUSE_DIR/release exists."""
    first, second = (tr.channels[ep] for ep in tr.program.pservers[:2])
    first_done = threading.Event()
    first_push, second_push = first.push_pull, second.push_pull

    def noted(at, *args, **kwargs):
        answer = first_push(at, *args, **kwargs)
        if at == step:
            first_done.set()
        return answer

    def held(at, *args, **kwargs):
        if at == step and not first_done.is_set():
            if not first_done.wait(60.0):
                raise TimeoutError(f"the push of step {step} to {first.endpoint} did not return within 60s")
            open(os.path.join(pause_dir, "held"), "w").close()
            wait_for(os.path.join(pause_dir, "release"), 120.0)
        return second_push(at, *args, **kwargs)

    first.push_pull, second.push_pull = noted, held
    for channel in (first, second):  # step's push takes the one-piece call, the one held here
        channel.start_push_pull = one_piece_at(step, channel.start_push_pull)


def one_piece_at(step: int, start_push_pull):
    """``start_push_pull`` that declines ``step``'s push (None: it goes as one push-pull call)."""

    def start(at, *args, **kwargs):
        return None if at == step else start_push_pull(at, *args, **kwargs)

    return start


def wait_for(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.02)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--async", dest="sync_mode", action="store_false")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--optimizer", default="momentum")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint_dir", required=True)
    p.add_argument("--checkpoint_every", type=int, default=5)
    p.add_argument("--heartbeat_interval", type=float, default=0.5)
    p.add_argument("--heartbeat_timeout", type=float, default=30.0)
    p.add_argument("--out_dir", required=True)
    p.add_argument("--pause_at", type=int, default=-1)
    p.add_argument("--pause_trainer", type=int, default=0)
    p.add_argument("--pause_dir", default="")
    p.add_argument(
        "--pause_every_trainer",
        action="store_true",
        help="every trainer pauses at --pause_at (PAUSE_DIR/reached-<id>), not only --pause_trainer",
    )
    p.add_argument("--counting", action="store_true", help="train counting_program() on counting_loss")
    p.add_argument("--hold_push", type=int, default=-1)
    p.add_argument("--hold_trainer", type=int, default=1)
    p.add_argument(
        "--takeover_timeout",
        type=float,
        default=30.0,
        help="hot standby: DistributeTranspilerConfig.replica_takeover_timeout",
    )
    p.add_argument(
        "--step_delay",
        type=float,
        default=0.0,
        help="seconds each trainer sleeps per step, until PAUSE_DIR/calm exists",
    )
    p.add_argument(
        "--hidden", type=int, default=HIDDEN, help=f"the hidden layer's width ({WIDE}: pushes split)"
    )
    p.add_argument("--push_lanes", type=int, default=1)
    p.add_argument("--record_claims", action="store_true", help="append to OUT_DIR/claims-<id>.jsonl")
    p.add_argument("--hold_after_claim", type=int, default=-1, help="see the module doc")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="the model's and data's (not --counting's)"
    )
    p.add_argument("--k_steps", type=int, default=0, help="GEO mode (with --async): sync every k_steps steps")
    p.add_argument(
        "--backup_trainers", type=int, default=0, help="sync: steps made by the first trainers - b"
    )
    p.add_argument(
        "--no_shared_memory",
        dest="shared_memory",
        action="store_false",
        help="every byte through gRPC: hosts emulated by network namespaces share /dev/shm",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    env = RoleEnv.from_env()
    config = DistributeTranspilerConfig(
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
        barrier_timeout=BARRIER_TIMEOUT,
        connect_timeout=60.0,
        recovery_timeout=60.0,
        replica_takeover_timeout=args.takeover_timeout,
        shared_memory=args.shared_memory,
        push_lanes=args.push_lanes,
        k_steps=args.k_steps,
        backup_trainers=args.backup_trainers,
    )
    t = DistributeTranspiler(config)
    dtype = DTYPES[args.dtype]
    program = (
        counting_program() if args.counting else build_program(args.optimizer, args.lr, args.hidden, dtype)
    )
    t.transpile(
        env.trainer_id,
        program=program,
        pservers=env.pserver_list,
        trainers=env.trainers,
        sync_mode=args.sync_mode,
    )
    if env.is_pserver:
        from pserver import ParameterServer
        from pserver.layout.joining import LeftJob

        prog = t.get_pserver_program(env.current_endpoint)
        try:
            ParameterServer(prog, t.get_startup_program(env.current_endpoint, prog)).serve()
        except LeftJob as e:  # started again after a change removed it
            logging.info("%s", e)
        return 0

    from trainer import Trainer

    data = dataset(dtype)
    tr = Trainer(t.get_trainer_program())
    tid = env.trainer_id
    if tid == args.hold_trainer and args.hold_push >= 0:
        hold_push(tr, args.hold_push, args.pause_dir)
    torch.save(tr.state_dict(), os.path.join(args.out_dir, f"start-{tid}.pt"))
    loader = DataLoader(data, batch_size=BATCH, sampler=tr.sampler(data, shuffle=True, seed=0))
    paused = False
    calm = os.path.join(args.pause_dir, "calm") if args.pause_dir else None
    replies = None
    if args.record_claims:
        hold = args.hold_after_claim if tid == args.pause_trainer else -1
        replies = record_claims(tr, hold, args.pause_dir)
        record = open(os.path.join(args.out_dir, f"claims-{tid}.jsonl"), "a")
    for x, y in tr.batches(loader, args.epochs):
        pauses = args.pause_every_trainer or tid == args.pause_trainer
        if pauses and tr.step_count == args.pause_at and not paused:
            paused = True
            reached = f"reached-{tid}" if args.pause_every_trainer else "reached"
            open(os.path.join(args.pause_dir, reached), "w").close()
            wait_for(os.path.join(args.pause_dir, "go"), 120.0)
        (counting_loss(tr.model, tid) if args.counting else loss_of(tr.model, x, y)).backward()
        at, (epoch, batch) = tr.step_count, tr.position
        tr.step()
        if replies is not None:
            line = dict(step=at, epoch=epoch, batch=batch, replies=replies.pop(at, []))
            record.write(json.dumps(line) + "\n")
            record.flush()
        if args.step_delay and not (calm and os.path.exists(calm)):
            time.sleep(args.step_delay)  # stretches the job so a chaos test's kills land while it trains
    torch.save(tr.state_dict(), os.path.join(args.out_dir, f"trainer-{tid}.pt"))
    if replies is not None:
        record.write(json.dumps(dict(final_step=tr.step_count)) + "\n")
        record.close()
    logging.info("trainer %d: finished at step %d", tid, tr.step_count)
    tr.close()
    return 0


if __name__ == "__main__":
    code = main()
    # Done (the trainer closed, the pserver stopped): spare the exit the interpreter's last collection over
    # torch's and dynamo's ~300k objects, which the tests wait for (1.9 s of each role's exit under load).
    gc.freeze()
    sys.exit(code)
