"""Bulk bytes between two hosts over gRPC Python: one connection or several lanes, push then pull or both
at once.

    sudo python -m benchmarks.bench_lanes [--lanes 1,2,4] [--chunks 262144,1048576,4194304]
                                          [--links unshaped,1gbit] [--mb 38.5] [--rounds 3] [--moves 8]

What issue 35's "bulk bytes in parallel lanes" would buy, measured before it is built: a trainer host moves
``--mb`` MB of gradients to a pserver host and gets as many bytes of parameters back (job D's 38.5 MB
model, one trainer's push and pull), over ``lanes`` gRPC channels at once, each its own TCP connection
(``grpc.use_local_subchannel_pool``, as this project's channels are), in chunks of ``chunk`` bytes. Two
ways to answer:

- ``turns``: the pserver answers once every byte arrived (a sync step today: the pull starts when the step
  applied);
- ``duplex``: it answers each chunk as it arrives (what answering a block as soon as its step applies would
  give: both directions of the link busy at once).

Transport only: raw bytes messages (this project's tensor calls pass raw bytes too), no codec, no engine.
Every configuration runs ``--moves`` timed moves after one untimed, ``--rounds`` rounds alternating over
the configurations; the report is each configuration's median MB/s of gradient bytes (one direction), and
for shaped links, that against the link's rate.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from typing import Dict, Iterator, List, Optional, Sequence

from harness.netns import Hosts, host_env

log = logging.getLogger("bench_lanes")

PORT = 47411
METHOD = "/bench.Lanes/Move"
OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.use_local_subchannel_pool", 1),
]
MODES = ("turns", "duplex")


def lane_bytes(total: int, lanes: int) -> List[int]:
    """How many of ``total`` bytes each of ``lanes`` lanes carries: equal shares, the remainder to the
    first."""
    if lanes < 1 or total < 0:
        raise ValueError(f"lanes >= 1 and total >= 0, got {lanes}, {total}")
    share = total // lanes
    return [share + (total - share * lanes if i == 0 else 0) for i in range(lanes)]


def chunk_sizes(total: int, chunk: int) -> List[int]:
    """``total`` bytes cut into chunks of at most ``chunk`` bytes."""
    if chunk < 1:
        raise ValueError(f"chunk >= 1, got {chunk}")
    return [min(chunk, total - at) for at in range(0, total, chunk)]


def link_bytes_per_s(link: str) -> Optional[float]:
    """The rate of a shaped link (``"1gbit"``) in bytes/s; None for ``unshaped``."""
    if link == "unshaped":
        return None
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, scale in units.items():
        if link.endswith(unit):
            return float(link[: -len(unit)]) * scale / 8
    raise ValueError(f"a link is unshaped or a rate like 1gbit, got {link!r}")


# -- the pserver side -------------------------------------------------------


def serve(address: str) -> None:
    """Answer Move calls: the first message's first byte says the mode; answers as many bytes as arrived."""
    import grpc

    block = bytes(64 << 20)

    def move(requests: Iterator[bytes], context) -> Iterator[bytes]:
        first = next(requests)
        duplex = first[:1] == b"d"
        sizes = [len(first)]
        if duplex:
            yield block[: len(first)]
        for data in requests:
            if duplex:
                yield block[: len(data)]
            else:
                sizes.append(len(data))
        if not duplex:
            for n in sizes:
                yield block[:n]

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        "bench.Lanes", {"Move": grpc.stream_stream_rpc_method_handler(move)}
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(address)
    server.start()
    server.wait_for_termination()


# -- the trainer side -------------------------------------------------------


PAYLOADS = {mode: mode[:1].encode() + bytes((64 << 20) - 1) for mode in MODES}  # the first byte says the mode


def move_once(calls, total: int, chunk: int, mode: str) -> float:
    """Move ``total`` bytes out and back over ``calls`` (one per lane) at once; seconds taken.

    Each chunk is a copy out of one buffer, as an encoded tensor is a copy out of its tensor.
    """
    payload = PAYLOADS[mode]
    errors: List[BaseException] = []

    def lane(call, nbytes: int) -> None:
        try:
            sizes = chunk_sizes(nbytes, chunk)
            got = sum(len(d) for d in call(iter([payload[:n] for n in sizes]), timeout=600))
            if got != nbytes:
                raise RuntimeError(f"lane got {got} bytes back, sent {nbytes}")
        except BaseException as e:  # noqa: B902 - reported by the caller
            errors.append(e)

    t0 = time.perf_counter()
    threads = [
        threading.Thread(target=lane, args=(c, n))
        for c, n in zip(calls, lane_bytes(total, len(calls)), strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def client(address: str, configs: Sequence[dict], total: int, moves: int) -> List[dict]:
    """Run every configuration once (``moves`` timed moves after one untimed); MB/s of each."""
    import grpc

    out = []
    for cfg in configs:
        channels = [
            grpc.insecure_channel(address, options=OPTIONS + [("bench.lane", i)]) for i in range(cfg["lanes"])
        ]
        try:
            for ch in channels:
                grpc.channel_ready_future(ch).result(timeout=30)
            calls = [ch.stream_stream(METHOD) for ch in channels]
            move_once(calls, total, cfg["chunk"], cfg["mode"])
            times = [move_once(calls, total, cfg["chunk"], cfg["mode"]) for _ in range(moves)]
        finally:
            for ch in channels:
                ch.close()
        out.append({**cfg, "mb_per_s": total / statistics.median(times) / 1e6})
    return out


# -- the run ----------------------------------------------------------------


def configurations(lanes: Sequence[int], chunks: Sequence[int]) -> List[dict]:
    """Every (mode, lanes, chunk) to measure."""
    return [{"mode": m, "lanes": n, "chunk": c} for m in MODES for n in lanes for c in chunks]


def run_link(link: str, configs: List[dict], total: int, rounds: int, moves: int) -> Dict[str, List[float]]:
    """Every configuration over ``link``, ``rounds`` rounds (each round in another order); MB/s per round
    by key."""
    rate = None if link == "unshaped" else link
    by_key: Dict[str, List[float]] = {}
    with Hosts(2, rate=rate) as hosts:
        server = subprocess.Popen(
            hosts.cmd(1, sys.executable, "-m", "benchmarks.bench_lanes", "--serve", f"{hosts.ip(1)}:{PORT}"),
            env=host_env(),
        )
        try:
            for r in range(rounds):
                order = configs if r % 2 == 0 else configs[::-1]
                argv = [
                    sys.executable,
                    "-m",
                    "benchmarks.bench_lanes",
                    "--client",
                    f"{hosts.ip(1)}:{PORT}",
                    "--configs",
                    json.dumps(order),
                    "--bytes",
                    str(total),
                    "--moves",
                    str(moves),
                ]
                done = subprocess.run(
                    hosts.cmd(2, *argv),
                    env=host_env(),
                    capture_output=True,
                    text=True,
                    timeout=1800,
                    check=True,
                )
                for row in json.loads(done.stdout.strip().splitlines()[-1]):
                    by_key.setdefault(key(row), []).append(row["mb_per_s"])
        finally:
            server.terminate()
            server.wait(timeout=30)
    return by_key


def key(cfg: dict) -> str:
    """A configuration's name in the report."""
    return f"{cfg['mode']} lanes={cfg['lanes']} chunk={cfg['chunk'] >> 10}KiB"


def report(link: str, by_key: Dict[str, List[float]]) -> str:
    """A markdown table: median MB/s [min-max], against one lane with the same mode and chunk, and the
    link."""
    rate = link_bytes_per_s(link)
    lines = [
        f"**{link}**",
        "",
        "| mode, lanes, chunk | MB/s one way | vs 1 lane | of the link |",
        "|---|---|---|---|",
    ]
    for k, vals in by_key.items():
        med = statistics.median(vals)
        one = statistics.median(by_key.get(k.replace(k.split()[1], "lanes=1"), vals))
        of_link = f"{med * 1e6 / rate:.0%}" if rate else "-"
        lines.append(f"| {k} | {med:.0f} [{min(vals):.0f}-{max(vals):.0f}] | {med / one:.2f} | {of_link} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lanes", default="1,2,4")
    p.add_argument("--chunks", default="262144,1048576,4194304")
    p.add_argument("--links", default="unshaped,1gbit")
    p.add_argument("--mb", type=float, default=38.5, help="MB each way per move (default: job D's model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--moves", type=int, default=8)
    p.add_argument("--json", help="write every round's figures here")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--configs", help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    if args.client:
        print(json.dumps(client(args.client, json.loads(args.configs), args.bytes, args.moves)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    configs = configurations(
        [int(x) for x in args.lanes.split(",")], [int(x) for x in args.chunks.split(",")]
    )
    total = int(args.mb * 1e6)
    results = {}
    for link in args.links.split(","):
        results[link] = run_link(link, configs, total, args.rounds, args.moves)
        print(report(link, results[link]) + "\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "mb": args.mb, "rounds": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
