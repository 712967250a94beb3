"""Train a little with checkpoints, then die by SIGKILL in the middle of writing the next one.

Usage: crash_in_checkpoint.py CKPT_DIR OUT_FILE KILL_POINT, KILL_POINT one of
``blocks`` (half of blocks.pt written), ``tables`` (a table shard's first array
written), ``manifest`` (everything but the manifest written). OUT_FILE gets the
trainer's state at the last complete checkpoint (step 2).
"""

import os
import signal
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository: harness, tests.helpers

from harness.cluster import LocalCluster  # noqa: E402
from pserver import atomic_files  # noqa: E402
from pserver.checkpoint import layout  # noqa: E402
from tests.helpers import checkpoint_models as cm  # noqa: E402


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def main(root: str, out: str, point: str) -> None:
    data = cm.batches(3)
    with LocalCluster(cm.program, 2, 1, config=cm.config(root)) as cluster:
        with cluster.trainer(0) as tr:
            cm.train(tr, data[:2])
            tr.checkpoint()
            torch.save(cm.snapshot(tr), out)
            cm.train(tr, data[2:])
            if point == "manifest":
                layout._write_manifest = die
            elif point == "tables":
                real = atomic_files.atomic_write

                def write_then_die(path, write):
                    real(path, write)
                    die()

                atomic_files.atomic_write = lambda path, write: (
                    write_then_die(path, write) if "tables" in path else real(path, write)
                )
            elif point == "blocks":

                def half(path, write):
                    with open(path + f".tmp-{os.getpid()}", "wb") as f:
                        f.write(b"\x80\x02half a pickle")
                        f.flush()
                    die()

                atomic_files.atomic_write = half
            tr.checkpoint()
    raise SystemExit("the checkpoint was not interrupted")


if __name__ == "__main__":
    main(*sys.argv[1:])
