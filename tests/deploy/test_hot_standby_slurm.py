"""The Slurm hot-standby recipe, checked offline: deploy/slurm/train-hot-standby.sbatch.

The batch script runs for real, with stand-ins for ``srun`` (which runs every task's command with
the variables Slurm gives the task), ``scontrol`` and ``etcd`` on PATH; the tasks' environments go
through the Slurm role source and resolve_replicas. With ``etcd`` installed, the script also starts
a real etcd that grants 1 s leases. The Kubernetes recipe: test_hot_standby_kubernetes.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from tests.deploy.hot_standby import ROOT, SBATCH, N, free_port_pair, resolved, shards
from transpiler import RoleEnv
from transpiler.roles import slurm as slurm_roles

# --- Slurm: the batch script with stand-ins for srun, scontrol and etcd ---------------------------------

# srun: runs the step's command once per task, as Slurm's block distribution places them, with the
# variables Slurm gives a task; records the batch script's own environment first.
FAKE_SRUN = r"""
import json, os, subprocess, sys, time
args = sys.argv[1:]
options = []
while args and args[0].startswith("-"):
    options.append(args.pop(0))
out = os.environ["FAKE_OUT"]
with open(os.path.join(out, "srun.json.tmp"), "w") as f:
    json.dump({"options": options, "command": args, "env": dict(os.environ), "pid": os.getpid()}, f)
os.replace(os.path.join(out, "srun.json.tmp"), os.path.join(out, "srun.json"))
if os.environ.get("FAKE_SRUN_HANG"):
    time.sleep(30)
nodes = os.environ["FAKE_NODES"].split(",")
per_node = int(os.environ["FAKE_TASKS_PER_NODE"])
tasks = []
for procid in range(len(nodes) * per_node):
    env = dict(os.environ, SLURM_PROCID=str(procid), SLURM_LOCALID=str(procid % per_node),
               SLURMD_NODENAME=nodes[procid // per_node],
               SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"],
               SLURM_STEP_TASKS_PER_NODE=os.environ["SLURM_TASKS_PER_NODE"],
               SLURM_STEP_NUM_TASKS=str(len(nodes) * per_node))
    tasks.append(subprocess.Popen(args, env=env))
sys.exit(max(task.wait() for task in tasks))
"""

# A task's script: records its environment (one line per run), fails when told to.
PROBE = r"""
import json, os, sys
out, procid = os.environ["FAKE_OUT"], os.environ["SLURM_PROCID"]
with open(os.path.join(out, f"task-{procid}.jsonl"), "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ)}) + "\n")
runs = sum(1 for _ in open(os.path.join(out, f"task-{procid}.jsonl")))
fail = os.environ.get("FAKE_FAIL", "")
if fail and fail.split(":")[0] == procid and runs <= int(fail.split(":")[1]):
    sys.exit(3)
"""

# etcd: answers /health on its loopback client URL until SIGTERM; records its arguments.
FAKE_ETCD = r"""
import http.server, json, os, signal, sys, threading
argv = sys.argv[1:]
flags = dict(zip(argv[::2], argv[1::2]))
with open(os.path.join(os.environ["FAKE_OUT"], "etcd.json"), "w") as f:
    json.dump({"argv": argv, "pid": os.getpid()}, f)
port = int(next(u for u in flags["--listen-client-urls"].split(",") if "127.0.0.1" in u).rsplit(":", 1)[1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"health":"true"}'
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), Health)
signal.signal(signal.SIGTERM, lambda *a: threading.Thread(target=server.shutdown).start())
server.serve_forever()
with open(os.path.join(os.environ["FAKE_OUT"], "etcd.stopped"), "w") as f:
    f.write("SIGTERM")
"""

FAKE_SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show node" ]; then
    echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1"
    echo "   NodeAddr=$FAKE_NODE_ADDR NodeHostName=$3 Version=23.11.4"
    exit 0
fi
echo "$*" >> "$FAKE_OUT/scontrol.log"
"""


class Batch:
    """A run of the batch script on 'node' n1 of a job on n[1-3], 2 tasks each."""

    def __init__(self, tmp_path: Path, nodes=("n1", "n2", "n3"), tasks_per_node=2):
        self.tmp = tmp_path
        self.out = tmp_path / "out"
        self.bin = tmp_path / "bin"
        self.scratch = tmp_path / "scratch"
        for d in (self.out, self.bin, self.scratch):
            d.mkdir(parents=True)
        # The stand-ins and the tasks' script need no site-packages: -S saves most of Python's start.
        for name, text in (("srun", FAKE_SRUN), ("etcd", FAKE_ETCD)):
            (self.bin / name).write_text(f"#!{sys.executable} -S\n{text}")
        (self.bin / "scontrol").write_text(FAKE_SCONTROL)
        (self.bin / "python").write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
        for name in ("srun", "etcd", "scontrol", "python"):
            (self.bin / name).chmod(0o755)
        self.probe = tmp_path / "probe.py"
        self.probe.write_text(PROBE)
        self.nodes, self.tasks_per_node = list(nodes), tasks_per_node
        self.etcd_port = free_port_pair()

    def env(self, **extra: str) -> Dict[str, str]:
        n = len(self.nodes)
        env = {
            "PATH": f"{self.bin}:{os.environ['PATH']}",
            "HOME": str(self.tmp),
            "TMPDIR": str(self.scratch),
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": f"n[1-{n}]" if n > 1 else self.nodes[0],
            "SLURM_JOB_NUM_NODES": str(n),
            "SLURM_NNODES": str(n),
            "SLURMD_NODENAME": self.nodes[0],
            "SLURM_TASKS_PER_NODE": f"{self.tasks_per_node}(x{n})" if n > 1 else str(self.tasks_per_node),
            "SLURM_NTASKS": str(n * self.tasks_per_node),
            "PS_PYTHON": str(self.bin / "python"),
            "PS_ETCD_PORT": str(self.etcd_port),
            "PS_CHECKPOINT_ROOT": str(self.tmp / "checkpoints"),
            "FAKE_OUT": str(self.out),
            "FAKE_NODES": ",".join(self.nodes),
            "FAKE_TASKS_PER_NODE": str(self.tasks_per_node),
            "FAKE_NODE_ADDR": "10.11.12.13",
            "PYTHONPATH": str(ROOT),
        }
        env.update(extra)
        return env

    def start(self, **extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            ["bash", str(SBATCH), str(self.probe)],
            env=self.env(**extra),
            cwd=self.tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, *args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(SBATCH), str(self.probe), *args],
            env=self.env(**extra),
            cwd=self.tmp,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def tasks(self) -> List[List[dict]]:
        """Every task's runs, in task order: the environment (and argv) of each run."""
        return [
            [json.loads(line) for line in (self.out / f"task-{t}.jsonl").read_text().splitlines()]
            for t in range(len(self.nodes) * self.tasks_per_node)
        ]

    def etcd_gone(self) -> bool:
        pid = json.loads((self.out / "etcd.json").read_text())["pid"]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.05)
        return False


def test_the_batch_script_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    directives = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --requeue" in directives


def test_every_task_finds_its_process_and_the_replicas(tmp_path, monkeypatch):
    batch = Batch(tmp_path)
    r = batch.run("--epochs", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    coordinator = f"http://10.11.12.13:{batch.etcd_port}"
    assert f"ps-train: etcd {coordinator}" in r.stdout
    srun = json.loads((batch.out / "srun.json").read_text())
    assert "--kill-on-bad-exit=1" in srun["options"] and "--distribution=block" in srun["options"]
    # etcd: bound to the first node's address (and loopback), 1 s leases, its data under the job's tmp.
    etcd = json.loads((batch.out / "etcd.json").read_text())["argv"]
    flags = dict(zip(etcd[::2], etcd[1::2]))
    assert flags["--listen-client-urls"].split(",") == [coordinator, f"http://127.0.0.1:{batch.etcd_port}"]
    assert flags["--advertise-client-urls"] == coordinator
    assert (flags["--heartbeat-interval"], flags["--election-timeout"]) == ("50", "500")
    assert flags["--data-dir"].startswith(str(batch.scratch / "ps-etcd-4242."))
    assert batch.etcd_gone() and (batch.out / "etcd.stopped").exists(), "the script's trap stops etcd"
    assert not list(batch.scratch.iterdir()), "and removes its data"

    pservers, replicas = ["n1:6170", "n1:6171"], ["n2:6170", "n2:6171"]
    runs = batch.tasks()
    assert [len(r) for r in runs] == [1] * 6
    envs = [r[0]["env"] for r in runs]
    assert all(
        r[0]["argv"] == ["--epochs", "1", "--checkpoint_dir", str(tmp_path / "checkpoints" / "4242")]
        for r in runs
    )
    config = None
    for t, env in enumerate(envs):
        assert (env["PS_SERVER_REPLICAS"], env["PS_PSERVER_NUM"], env["PS_COORDINATOR"]) == (
            "2",
            "2",
            coordinator,
        )
        role, read = slurm_roles.discover(env), RoleEnv.from_env(env)
        fields = ("role", "pservers", "trainers", "trainer_id", "current_endpoint", "source")
        assert [getattr(role, f) for f in fields] == [
            getattr(read, f) for f in fields
        ] and role.source == "slurm"
        assert role.pservers == pservers and role.trainers == 2
        if t < 4:
            assert (role.role, role.current_endpoint) == ("PSERVER", (pservers + replicas)[t])
        else:
            assert (role.role, role.trainer_id) == ("TRAINER", t - 4)
        config = resolved(env, role.pservers)
        assert (
            config.server_replicas,
            config.replica_endpoints,
            config.coordinator,
            config.coordinator_prefix,
        ) == (2, ",".join(replicas), coordinator, "/torch-pserver/slurm-4242.0")
    got = shards(config, slurm_roles.discover(envs[0]), pservers + replicas, monkeypatch)
    for i in range(N):
        assert got[replicas[i]] == got[pservers[i]] and got[pservers[i]][0] == i and got[pservers[i]][1]
    assert got[pservers[0]] != got[pservers[1]]


def test_a_failed_pserver_process_starts_again_and_a_failed_trainer_ends_the_step(tmp_path):
    batch = Batch(tmp_path)
    r = batch.run(FAKE_FAIL="3:1")  # task 3 (pserver 1's second process) fails its first run
    assert r.returncode == 0, r.stdout + r.stderr
    assert [len(runs) for runs in batch.tasks()] == [1, 1, 1, 2, 1, 1]
    assert "pserver process 3 exited with status 3; starting it again (1 of at most 3)" in r.stderr
    assert batch.etcd_gone()

    batch = Batch(tmp_path / "second")
    r = batch.run(FAKE_FAIL="5:1", PS_PSERVER_RESTARTS="0")  # trainer 1 fails: never started again
    assert r.returncode == 3, r.stdout + r.stderr
    assert [len(runs) for runs in batch.tasks()] == [1] * 6
    assert "starting it again" not in r.stderr
    assert batch.etcd_gone() and not list(batch.scratch.iterdir())
    assert not (batch.out / "scontrol.log").exists()  # PS_MAX_REQUEUES=0: no requeue


def test_etcd_stops_when_the_job_is_cancelled(tmp_path):
    # scancel or the time limit: SIGTERM to the batch script and the step; the script's traps stop etcd.
    batch = Batch(tmp_path)
    proc = batch.start(FAKE_SRUN_HANG="1")
    try:
        deadline = time.monotonic() + 20
        while not (batch.out / "srun.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(json.loads((batch.out / "srun.json").read_text())["pid"], signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, out + err
    assert batch.etcd_gone() and not list(batch.scratch.iterdir())


def test_the_script_stops_before_srun_when_etcd_cannot_serve_the_job(tmp_path):
    batch = Batch(tmp_path)
    r = batch.run(FAKE_NODE_ADDR="127.0.1.1")  # Debian's /etc/hosts entry for the host's own name
    assert r.returncode == 1
    assert "node n1 resolves to 127.0.1.1, a loopback address the job's other nodes cannot reach" in r.stderr
    assert not (batch.out / "etcd.json").exists() and not (batch.out / "srun.json").exists()
    # Too few tasks for 2 x PS_PSERVER_NUM pserver processes and a trainer: refused before etcd starts.
    r = batch.run(PS_PSERVER_NUM="3")
    assert r.returncode == 2 and "PS_PSERVER_NUM=3 pservers need 6 pserver processes" in r.stderr
    assert not (batch.out / "etcd.json").exists()
    # An etcd that exits at once (say, its port taken): its log's tail, no step, its directory removed.
    (batch.bin / "etcd").write_text("#!/bin/sh\necho 'bind: address already in use' >&2\nexit 1\n")
    r = batch.run()
    assert r.returncode == 1 and "etcd did not start" in r.stderr and "address already in use" in r.stderr
    assert not (batch.out / "srun.json").exists() and not list(batch.scratch.iterdir())


def test_an_etcd_given_in_ps_coordinator_is_used_as_is(tmp_path):
    batch = Batch(tmp_path)
    r = batch.run(PS_COORDINATOR="http://etcd.example:2379", PS_COORDINATOR_PREFIX="/mine")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (batch.out / "etcd.json").exists()
    env = batch.tasks()[0][0]["env"]
    assert (env["PS_COORDINATOR"], env["PS_COORDINATOR_PREFIX"]) == ("http://etcd.example:2379", "/mine")
    # PS_ETCD_HOST instead of the node's NodeAddr: the address etcd binds and the tasks dial.
    batch = Batch(tmp_path / "again")
    r = batch.run(PS_ETCD_HOST="10.9.8.7")
    assert r.returncode == 0, r.stdout + r.stderr
    etcd = json.loads((batch.out / "etcd.json").read_text())["argv"]
    assert etcd[etcd.index("--advertise-client-urls") + 1] == f"http://10.9.8.7:{batch.etcd_port}"
    assert batch.tasks()[4][0]["env"]["PS_COORDINATOR"] == f"http://10.9.8.7:{batch.etcd_port}"


# srun for a real etcd: the lease TTL the coordinator grants, then the tasks as usual.
LEASE_SRUN = (
    r"""
import json, os, urllib.request
request = urllib.request.Request(os.environ["PS_COORDINATOR"] + "/v3/lease/grant", data=b'{"TTL": 1}',
                                 headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=5) as r:
    ttl = json.load(r)["TTL"]
with open(os.path.join(os.environ["FAKE_OUT"], "lease.json"), "w") as f:
    json.dump({"ttl": int(ttl)}, f)
"""
    + FAKE_SRUN
)


def test_the_batch_script_starts_a_real_etcd_with_1s_leases(tmp_path, etcd_binary):
    batch = Batch(tmp_path, nodes=("n1",), tasks_per_node=3)  # one pserver, its second process, a trainer
    (batch.bin / "etcd").unlink()
    (batch.bin / "srun").write_text(f"#!{sys.executable} -S\n{LEASE_SRUN}")
    r = batch.run(PS_PSERVER_NUM="1", PS_ETCD=etcd_binary, FAKE_NODE_ADDR="127.0.0.1")
    assert r.returncode == 0, r.stdout + r.stderr + (tmp_path / "ps-etcd-4242.log").read_text()[-2000:]
    assert json.loads((batch.out / "lease.json").read_text()) == {"ttl": 1}
    assert f"ps-train: etcd http://127.0.0.1:{batch.etcd_port}" in r.stdout
    assert not list(batch.scratch.iterdir()), "the trap stops etcd and removes its data"
    with pytest.raises(ConnectionRefusedError):  # etcd is gone
        socket.create_connection(("127.0.0.1", batch.etcd_port), timeout=2).close()
    env = batch.tasks()[1][0]["env"]
    role = slurm_roles.discover(env)
    assert (role.role, role.current_endpoint, role.pservers) == ("PSERVER", "n1:6171", ["n1:6170"])
    assert resolved(env, role.pservers).replica_endpoints == "n1:6171"
