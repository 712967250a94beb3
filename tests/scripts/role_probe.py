"""A stand-in training script for the ps-launch tests; no torch, so it starts fast.

Every role first records its pid, argv and role variables in ``$PROBE_DIR/<role>.<index>.json``
(written atomically, so a test can wait for it), then behaves as told:

trainers (``--trainer``):  ok    write ``trainer.<id>.done`` and exit 0
                           fail  trainer ``--fail_id`` waits for every role to start, prints to
                                 stderr and exits 3; the others hang
                           hang  wait for SIGTERM
pservers (``--pserver``):  wait         exit 0 once every trainer wrote its done file (like a real
                                        pserver after all trainers closed)
                           forever      wait for SIGTERM
                           ignore-term  record SIGTERM but keep running (only SIGKILL ends it)
                           crash        pserver ``--crash_id`` exits 5 once every role started;
                                        the others run forever

A role stopped by SIGTERM writes ``<role>.<index>.sigterm`` and exits 0. Nothing waits
longer than ``--deadline`` seconds, so a broken launcher cannot leave these running.
"""

import argparse
import glob
import json
import os
import signal
import sys
import time

ROLE_VARS = (
    "TRAINING_ROLE",
    "PADDLE_PSERVERS_IP_PORT_LIST",
    "PADDLE_TRAINERS_NUM",
    "PADDLE_TRAINER_ID",
    "POD_IP",
    "PADDLE_PORT",
    "PYTHONUNBUFFERED",
    "PS_AUTH_TOKEN",
)


def write_json(path, data):
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--trainer", default="ok", choices=["ok", "fail", "hang"])
    p.add_argument("--pserver", default="wait", choices=["wait", "forever", "ignore-term", "crash"])
    p.add_argument("--fail_id", type=int, default=0)
    p.add_argument("--crash_id", type=int, default=0)
    p.add_argument("--deadline", type=float, default=60.0)
    args, _ = p.parse_known_args()
    out = os.environ["PROBE_DIR"]
    role = os.environ["TRAINING_ROLE"]
    if role == "TRAINER":
        name = f"trainer.{os.environ['PADDLE_TRAINER_ID']}"
    else:
        me = f"{os.environ['POD_IP']}:{os.environ['PADDLE_PORT']}"
        name = f"pserver.{os.environ['PADDLE_PSERVERS_IP_PORT_LIST'].split(',').index(me)}"
    index = int(name.split(".")[1])
    terminated = []

    def on_sigterm(signum, frame):
        open(os.path.join(out, name + ".sigterm"), "w").close()
        terminated.append(signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    write_json(
        os.path.join(out, name + ".json"),
        {
            "pid": os.getpid(),
            "argv": sys.argv[1:],
            "cwd": os.getcwd(),
            "env": {k: os.environ.get(k) for k in ROLE_VARS},
        },
    )
    print(f"{name} started (pid {os.getpid()})", flush=True)

    def wait_until(done):
        deadline = time.monotonic() + args.deadline
        while not done():
            if time.monotonic() > deadline:
                print(f"{name}: deadline passed", flush=True)
                sys.exit(4)
            time.sleep(0.05)

    def everyone_started():
        everyone = int(os.environ["PADDLE_TRAINERS_NUM"]) + len(
            os.environ["PADDLE_PSERVERS_IP_PORT_LIST"].split(",")
        )
        return len(glob.glob(os.path.join(out, "*.json"))) >= everyone

    if role == "TRAINER":
        if args.trainer == "ok":
            open(os.path.join(out, name + ".done"), "w").close()
            print(f"{name} finished", flush=True)
            return 0
        if args.trainer == "fail" and index == args.fail_id:
            wait_until(everyone_started)  # so the test sees the launcher stop running roles
            print(f"{name}: boom, the training step failed", file=sys.stderr, flush=True)
            write_json(os.path.join(out, name + ".failed"), {"at": time.time()})
            return 3
        wait_until(lambda: terminated)
        return 0
    if args.pserver == "crash" and index == args.crash_id:
        wait_until(everyone_started)
        print(f"{name}: crashing", file=sys.stderr, flush=True)
        return 5
    if args.pserver == "wait":
        trainers = int(os.environ["PADDLE_TRAINERS_NUM"])
        wait_until(lambda: terminated or len(glob.glob(os.path.join(out, "trainer.*.done"))) >= trainers)
    elif args.pserver == "ignore-term":
        wait_until(lambda: False)
    else:
        wait_until(lambda: terminated)
    print(f"{name} exiting", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
