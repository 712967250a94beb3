"""One local process of a trainer node that torchrun started across nodes
(tests/trainer/test_torchrun_nodes.py).

Run as ``python -m torch.distributed.run --nnodes 2 --node-rank N ... torchrun_node.py OUT_DIR`` with
``TRAINING_ROLE=TRAINER`` and ``PADDLE_PSERVERS_IP_PORT_LIST`` set; the pservers serve
``harness/models.py:odd_program``. The role comes from torchrun's variables alone
(``RoleEnv.from_env``: trainer id = ``GROUP_RANK``), the node's process group from the Trainer's own choice
of rendezvous (no ``init_method`` given). The process trains one step per batch of ``DATA`` (its own,
``RANK`` = node x local world size + local rank) and saves ``OUT_DIR/node<N>-rank<R>.pt`` = (state_dict,
step count, trainer id).

First it records its pid in ``OUT_DIR/trainer.<N>.<R>.json`` (torchrun starts workers in sessions of their
own: the test kills what it recorded) and asks Linux to SIGKILL it when its torchrun agent dies, so no
worker outlives a failed test.
"""

import ctypes
import gc
import json
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
STEPS, PER_PROCESS = 3, 6


def record(out_dir: str) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the agent died before prctl: nothing would kill this process later
        sys.exit(1)
    name = f"trainer.{os.environ['GROUP_RANK']}.{os.environ['LOCAL_RANK']}"
    path = os.path.join(out_dir, name + ".json")
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid()}, f)
    os.replace(path + ".tmp", path)


def data():
    """Every process's batches: ``data()[step][rank]``, float64 (the pservers' program is float64)."""
    import torch

    from harness.models import batches

    return batches(4, PER_PROCESS, STEPS, dtype=torch.float64)


def main(out_dir: str) -> None:
    record(out_dir)
    import logging

    import torch
    from torch import nn

    from harness.models import odd_program
    from psproto.security import Security
    from trainer import Trainer
    from transpiler import DistributeTranspiler, RoleEnv

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    env = RoleEnv.from_env()
    assert env is not None and env.source == "torchrun", env
    t = DistributeTranspiler()
    t.transpile(env.trainer_id, program=odd_program(), pservers=env.pservers, trainers=env.trainers)
    me = env.trainer_id * env.local_world_size + env.local_rank
    mine = [step_batches[me] for step_batches in data()]
    with Trainer(t.get_trainer_program(), security=Security()) as tr:
        for x, y in tr.batches(mine, 1):
            nn.functional.cross_entropy(tr.model(x), y).backward()
            tr.step()
        torch.save(
            (tr.state_dict(), tr.step_count, tr.trainer_id),
            os.path.join(out_dir, f"node{env.trainer_id}-rank{env.local_rank}.pt"),
        )
    gc.freeze()  # done: a quicker exit (tests/helpers/nodes.py, PROCESS_TIMEOUT's note)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(sys.argv[1])
