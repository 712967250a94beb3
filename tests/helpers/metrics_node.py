"""A local rank of a trainer node that reports global metrics (tests/pserver/test_metrics.py); spawned, so
it imports little."""

from __future__ import annotations

import gc
from typing import Sequence


def node_rank(build, endpoints: Sequence[str], local_rank: int, port: int, out: str, timeout: float) -> None:
    """Local rank ``local_rank`` of trainer node 0 (2 local processes, 2 trainers): its global sum and max."""
    import torch

    from psproto.security import Security
    from trainer import Trainer, job_metrics
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    torch.set_num_threads(1)
    t = DistributeTranspiler(DistributeTranspilerConfig(barrier_timeout=timeout))
    t.transpile(0, program=build(), pservers=",".join(endpoints), trainers=2)
    with Trainer(
        t.get_trainer_program(),
        security=Security(),
        local_rank=local_rank,
        local_world_size=2,
        init_method=f"tcp://127.0.0.1:{port}",
    ) as tr:
        got = (
            job_metrics.global_sum(tr, "n", [1.0, 10.0][local_rank]),
            job_metrics.global_max(tr, "m", local_rank),
        )
    torch.save(got, out)
    gc.freeze()  # its result written: a quicker exit (tests/helpers/nodes.py, PROCESS_TIMEOUT's note)
