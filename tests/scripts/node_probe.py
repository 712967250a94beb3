"""A stand-in training script for ps-launch's trainer-node tests; no torch, so it starts fast.

Every process first records its pid and environment (role, node and CUDA variables) in
``$PROBE_DIR/<name>.json``, written atomically, where <name> is ``pserver.<i>`` or
``trainer.<node>.<local rank>``, then:

trainers:  without ``--kill``: write ``<name>.done`` and exit 0.
           ``--kill N.R``: trainer node N's local rank R waits until every process of the job
           has recorded itself, writes ``<name>.killed`` and SIGKILLs itself; every other
           trainer waits for SIGTERM, as its node's processes would wait in a collective.
pservers:  exit 0 once every trainer process wrote its done file (``--nproc`` per node).

A process stopped by SIGTERM writes ``<name>.sigterm`` and exits 0. Nothing waits longer
than ``--deadline`` seconds, so a broken launcher cannot leave these running.
"""

import argparse
import glob
import json
import os
import signal
import sys
import time

RECORDED = (
    "TRAINING_ROLE",
    "PADDLE_PSERVERS_IP_PORT_LIST",
    "PADDLE_TRAINERS_NUM",
    "PADDLE_TRAINER_ID",
    "POD_IP",
    "PADDLE_PORT",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONUNBUFFERED",
)


def write_json(path, data):
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kill", metavar="NODE.RANK")
    p.add_argument("--nproc", type=int, default=1, help="processes per trainer node")
    p.add_argument("--deadline", type=float, default=60.0)
    args = p.parse_args()
    out = os.environ["PROBE_DIR"]
    pservers = [e for e in os.environ.get("PADDLE_PSERVERS_IP_PORT_LIST", "").split(",") if e]
    trainer_procs = int(os.environ["PADDLE_TRAINERS_NUM"]) * args.nproc
    if os.environ["TRAINING_ROLE"] == "TRAINER":
        name = f"trainer.{os.environ['PADDLE_TRAINER_ID']}.{os.environ.get('LOCAL_RANK', '0')}"
    else:
        name = f"pserver.{pservers.index(os.environ['POD_IP'] + ':' + os.environ['PADDLE_PORT'])}"
    terminated = []

    def on_sigterm(signum, frame):
        open(os.path.join(out, name + ".sigterm"), "w").close()
        terminated.append(signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    write_json(
        os.path.join(out, name + ".json"),
        {"pid": os.getpid(), "env": {k: os.environ.get(k) for k in RECORDED}},
    )
    print(f"{name} started (pid {os.getpid()})", flush=True)

    def wait_until(done):
        deadline = time.monotonic() + args.deadline
        while not done():
            if time.monotonic() > deadline:
                print(f"{name}: deadline passed", flush=True)
                sys.exit(4)
            time.sleep(0.05)

    if name.startswith("pserver"):
        wait_until(lambda: terminated or len(glob.glob(os.path.join(out, "trainer.*.done"))) >= trainer_procs)
    elif args.kill is None:
        open(os.path.join(out, name + ".done"), "w").close()
    elif name == f"trainer.{args.kill}":
        everyone = len(pservers) + trainer_procs
        wait_until(lambda: len(glob.glob(os.path.join(out, "*.json"))) >= everyone)
        print(f"{name}: killing myself", flush=True)
        write_json(os.path.join(out, name + ".killed"), {"at": time.time()})
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        wait_until(lambda: terminated)
    print(f"{name} exiting", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
