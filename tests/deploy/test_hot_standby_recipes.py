"""The hot-standby recipes, checked offline: deploy/kubernetes/hot-standby/ and deploy/slurm/train-hot-standby.sbatch.

Kubernetes: the kustomization is built here in Python (its resources, then its RFC 6902 patches;
where ``kubectl`` or ``kustomize`` is installed the result must equal theirs), every object is
validated against the API schemas, and every pod the objects make reads an environment from which
RoleEnv.from_env and resolve_replicas give its place among the 2 pservers and their 2 second
processes; the transpiler gives pod N+i pserver i's shard.

Slurm: the batch script runs for real, with stand-ins for ``srun`` (which runs every task's command
with the variables Slurm gives the task), ``scontrol`` and ``etcd`` on PATH; the tasks' environments
go through the Slurm role source and resolve_replicas. With ``etcd`` installed, the script also
starts a real etcd, and the etcd flags of both recipes are checked to give 1 s leases.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, List

import kubernetes_validate
import pytest
import yaml
from torch import nn

from tests.deploy.test_kubernetes_manifests import (VERSIONS, container, indexed_job_pods, load_entrypoint, port_named,
                                             statefulset_pods)
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program, RoleEnv
from transpiler.roles.replicas import resolve_replicas
from transpiler.roles import slurm as slurm_roles
from tests.helpers import paths

ROOT = paths.REPO
HOT_STANDBY = ROOT / "deploy" / "kubernetes" / "hot-standby"
SBATCH = ROOT / "deploy" / "slurm" / "train-hot-standby.sbatch"
N = 2  # pservers (PS_PSERVER_NUM) in both recipes
COORDINATOR = "http://ps-etcd:2379"
PSERVERS = [f"ps-pserver-{i}.ps-pserver:6170" for i in range(N)]
REPLICAS = [f"ps-pserver-{N + i}.ps-pserver:6170" for i in range(N)]
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches"}  # what build() below implements


# --- the kustomization, built here ------------------------------------------------------------------

def _pointer(path: str) -> List[str]:
    assert path.startswith("/"), path
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _apply_op(doc: dict, op: dict) -> None:
    """One RFC 6902 operation (add, replace, remove, test) on ``doc``, in place."""
    *parents, last = _pointer(op["path"])
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    kind = op["op"]
    if kind == "test":
        current = node[int(last)] if isinstance(node, list) else node[last]
        assert current == op["value"], op
    elif isinstance(node, list):
        if kind == "add":
            node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
        elif kind == "replace":
            node[int(last)] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del node[int(last)]
        else:
            raise AssertionError(f"unsupported JSON patch operation {op}")
    else:
        if kind == "replace" or kind == "remove":
            assert last in node, f"{kind} of a missing member: {op['path']}"
        if kind in ("add", "replace"):
            node[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del node[last]
        else:
            raise AssertionError(f"unsupported JSON patch operation {op}")


def _matches(doc: dict, target: dict) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    wanted = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    assert set(target) <= set(wanted), f"unsupported patch target fields {set(target) - set(wanted)}"
    return all(wanted[k] == v for k, v in target.items())


def kustomization() -> dict:
    return yaml.safe_load((HOT_STANDBY / "kustomization.yaml").read_text())


def build() -> List[dict]:
    """What ``kustomize build`` makes of the directory: the resources' documents, then each patch applied."""
    k = kustomization()
    assert set(k) <= KUSTOMIZATION_KEYS, f"build() here does not implement {set(k) - KUSTOMIZATION_KEYS}"
    docs = [d for resource in k["resources"]
            for d in yaml.safe_load_all((HOT_STANDBY / resource).read_text()) if d is not None]
    for patch in k.get("patches", []):
        assert set(patch) == {"path", "target"}, f"build() here implements file patches with a target: {patch}"
        targets = [d for d in docs if _matches(d, patch["target"])]
        assert len(targets) == 1, f"patch {patch['path']} matches {len(targets)} objects"
        ops = yaml.safe_load((HOT_STANDBY / patch["path"]).read_text())
        assert isinstance(ops, list), f"{patch['path']} is not a JSON patch (a list of operations)"
        for op in ops:
            _apply_op(targets[0], op)
    return docs


def one(docs: List[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _key(doc: dict):
    return doc["kind"], doc["metadata"]["name"]


def test_kustomization_builds_like_kustomize():
    docs = build()
    assert sorted(map(_key, docs)) == sorted([
        ("Service", "ps-pserver"), ("StatefulSet", "ps-pserver"), ("Job", "ps-trainer"),
        ("Service", "ps-etcd"), ("StatefulSet", "ps-etcd"), ("PodDisruptionBudget", "ps-pserver")])
    # Neither the Secret nor the checkpoint claim: deleting these objects between runs keeps the checkpoints.
    assert not {"Secret", "PersistentVolumeClaim"} & {d["kind"] for d in docs}
    if shutil.which("kustomize"):
        command = ["kustomize", "build"]
    elif shutil.which("kubectl"):
        command = ["kubectl", "kustomize"]
    else:
        return  # the Python build above is the check
    r = subprocess.run([*command, "--load-restrictor", "LoadRestrictionsNone", str(HOT_STANDBY)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    theirs = sorted(yaml.safe_load_all(r.stdout), key=_key)
    assert theirs == sorted(docs, key=_key)


@pytest.mark.parametrize("version", VERSIONS)
def test_hot_standby_objects_match_the_kubernetes_api(version):
    for doc in build():
        kubernetes_validate.validate(doc, version, strict=True)


def test_patches_change_only_the_hot_standby_settings():
    base = {_key(d): d for name in ("pserver-statefulset.yaml", "trainer-job.yaml")
            for d in yaml.safe_load_all((HOT_STANDBY.parent / name).read_text())}
    docs = build()
    for key, original in base.items():
        patched = one(docs, *key)
        spec, before = patched["spec"]["template"]["spec"], original["spec"]["template"]["spec"]
        env, old_env = container(spec)["env"], container(before)["env"]
        assert env[:len(old_env)] == old_env, "the base variables stay as they are"
        names = [v["name"] for v in env]
        assert len(names) == len(set(names)), f"a variable set twice in {key}: {names}"
        rest = copy.deepcopy(patched)
        container(rest["spec"]["template"]["spec"])["env"] = old_env
        rest["spec"]["template"]["spec"].pop("affinity", None)
        if key[0] == "StatefulSet":
            rest["spec"]["replicas"] = original["spec"]["replicas"]
        assert rest == original, f"{key}: the patch changes more than env, affinity and replicas"


# --- the roles every pod finds ------------------------------------------------------------------------

def small_program() -> Program:
    # Big enough for blocks on both pservers (min_block_size is 8192 elements).
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return Program(model, "sgd", lr=0.1)


def resolved(env: Dict[str, str], pservers: List[str]) -> DistributeTranspilerConfig:
    return resolve_replicas(DistributeTranspilerConfig(), pservers, env)


def shards(config: DistributeTranspilerConfig, role: RoleEnv, endpoints: List[str], monkeypatch) -> Dict[str, tuple]:
    """Each endpoint's shard and block names, from a transpile with ``config`` (resolved from the pod's env)."""
    for var in ("PS_SERVER_REPLICAS", "PS_REPLICA_ENDPOINTS", "PS_COORDINATOR", "PS_COORDINATOR_PREFIX"):
        monkeypatch.delenv(var, raising=False)  # transpile reads os.environ for fields left None
    t = DistributeTranspiler(config)
    t.transpile(0, program=small_program(), pservers=role.pservers, trainers=role.trainers)
    programs = {ep: t.get_pserver_program(ep) for ep in endpoints}
    return {ep: (p.shard, tuple(b.name for b in p.blocks)) for ep, p in programs.items()}


def test_every_pod_finds_its_process_and_the_replicas(monkeypatch):
    docs = build()
    sts, job = one(docs, "StatefulSet", "ps-pserver"), one(docs, "Job", "ps-trainer")
    pserver_pods, trainer_pods = statefulset_pods(sts), indexed_job_pods(job)
    assert sts["spec"]["replicas"] == 2 * N == 2 * int(pserver_pods[0]["PS_PSERVER_NUM"])
    assert PSERVERS[0] == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}:" \
        f"{port_named(sts['spec']['template']['spec'], 'grpc')}"
    processes = PSERVERS + REPLICAS
    config = None
    for i, env in enumerate(pserver_pods):
        role = RoleEnv.from_env(env)
        assert (role.role, role.source, role.current_endpoint) == ("PSERVER", "kubernetes", processes[i])
        assert role.pservers == PSERVERS and role.trainers == len(trainer_pods)
        config = resolved(env, role.pservers)
        assert (config.server_replicas, config.replica_endpoints, config.coordinator) == \
            (2, ",".join(REPLICAS), COORDINATOR)
        assert config.coordinator_prefix is None  # every pod the same default: /torch-pserver/<layout digest>
        # The image's entry point holds each pod until its own name resolves, second processes included.
        assert load_entrypoint().name_to_wait_for(role) == processes[i].rpartition(":")[0]
    for i, env in enumerate(trainer_pods):
        role = RoleEnv.from_env(env)
        assert (role.role, role.trainer_id, role.pservers) == ("TRAINER", i, PSERVERS)
        assert (resolved(env, role.pservers).replica_endpoints, resolved(env, role.pservers).coordinator) == \
            (",".join(REPLICAS), COORDINATOR)
    # Pod N+i (its own current endpoint) serves pserver i's blocks; the two shards differ, both hold blocks.
    current = [RoleEnv.from_env(env).current_endpoint for env in pserver_pods]
    got = shards(config, RoleEnv.from_env(pserver_pods[-1]), current, monkeypatch)
    for i in range(N):
        assert got[current[N + i]] == got[current[i]] and got[current[i]][0] == i and got[current[i]][1]
    assert got[current[0]] != got[current[1]]


def test_a_pod_beyond_2n_is_refused():
    sts = one(build(), "StatefulSet", "ps-pserver")
    env = {**statefulset_pods(sts)[0], "HOSTNAME": f"ps-pserver-{2 * N}"}
    with pytest.raises(ValueError, match="scale the StatefulSet to PS_PSERVER_NUM x PS_SERVER_REPLICAS"):
        RoleEnv.from_env(env)


def etcd_flags(command: List[str]) -> Dict[str, str]:
    flags = {}
    for arg in command[1:]:
        assert arg.startswith("--") and "=" in arg, f"write etcd flags as --name=value: {arg}"
        name, _, value = arg[2:].partition("=")
        flags[name] = value
    return flags


def test_etcd_serves_the_coordinator_url_durably_with_1s_leases():
    docs = build()
    svc, sts = one(docs, "Service", "ps-etcd"), one(docs, "StatefulSet", "ps-etcd")
    spec = sts["spec"]["template"]["spec"]
    etcd = container(spec, "etcd")
    flags = etcd_flags(etcd["command"])
    client = port_named(spec, "client", "etcd")
    (svc_port,) = svc["spec"]["ports"]
    assert COORDINATOR == f"http://{svc['metadata']['name']}:{svc_port['port']}" == flags["advertise-client-urls"]
    assert svc_port["targetPort"] == "client" and flags["listen-client-urls"] == f"http://0.0.0.0:{client}"
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["replicas"] == 1 and flags["initial-cluster"].startswith(flags["name"] + "=")
    # The lease TTL etcd grants is at least 1.5 x the election timeout, rounded up to whole seconds.
    assert int(flags["heartbeat-interval"]) == 50 and int(flags["election-timeout"]) == 500
    assert -(-15 * int(flags["election-timeout"]) // 10000) == 1
    # Its data on the claim of every pod (not an emptyDir), in a directory etcd makes itself.
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (mount,) = etcd["volumeMounts"]
    assert mount["name"] == claim["metadata"]["name"] and not spec.get("volumes")
    assert flags["data-dir"].startswith(mount["mountPath"] + "/")
    metrics = port_named(spec, "metrics", "etcd")
    assert flags["listen-metrics-urls"] == f"http://0.0.0.0:{metrics}"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert etcd[probe]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert "cpu" not in etcd["resources"].get("limits", {}), "a throttled etcd fences healthy primaries"


def test_selectors_keep_pservers_trainers_and_etcd_apart():
    docs = build()
    labels = {key: one(docs, *key)["spec"]["template"]["metadata"]["labels"]
              for key in (("StatefulSet", "ps-pserver"), ("Job", "ps-trainer"), ("StatefulSet", "ps-etcd"))}
    selectors = {"pserver Service": (one(docs, "Service", "ps-pserver")["spec"]["selector"], "ps-pserver"),
                 "etcd Service": (one(docs, "Service", "ps-etcd")["spec"]["selector"], "ps-etcd"),
                 "disruption budget": (one(docs, "PodDisruptionBudget", "ps-pserver")["spec"]["selector"]
                                       ["matchLabels"], "ps-pserver")}
    for what, (selector, owner) in selectors.items():
        for (kind, name), pod_labels in labels.items():
            selected = selector.items() <= pod_labels.items()
            assert selected == (name == owner and kind == "StatefulSet"), f"{what} and the {name} pods"
    assert one(docs, "PodDisruptionBudget", "ps-pserver")["spec"]["maxUnavailable"] == 1
    term = one(docs, "StatefulSet", "ps-pserver")["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"].items() <= labels[("StatefulSet", "ps-pserver")].items()


# --- Slurm: the batch script with stand-ins for srun, scontrol and etcd ---------------------------------

# srun: runs the step's command once per task, as Slurm's block distribution places them, with the
# variables Slurm gives a task; records the batch script's own environment first.
FAKE_SRUN = r'''
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
               SLURMD_NODENAME=nodes[procid // per_node], SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"],
               SLURM_STEP_TASKS_PER_NODE=os.environ["SLURM_TASKS_PER_NODE"],
               SLURM_STEP_NUM_TASKS=str(len(nodes) * per_node))
    tasks.append(subprocess.Popen(args, env=env))
sys.exit(max(task.wait() for task in tasks))
'''

# A task's script: records its environment (one line per run), fails when told to.
PROBE = r'''
import json, os, sys
out, procid = os.environ["FAKE_OUT"], os.environ["SLURM_PROCID"]
with open(os.path.join(out, f"task-{procid}.jsonl"), "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ)}) + "\n")
runs = sum(1 for _ in open(os.path.join(out, f"task-{procid}.jsonl")))
fail = os.environ.get("FAKE_FAIL", "")
if fail and fail.split(":")[0] == procid and runs <= int(fail.split(":")[1]):
    sys.exit(3)
'''

# etcd: answers /health on its loopback client URL until SIGTERM; records its arguments.
FAKE_ETCD = r'''
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
'''

FAKE_SCONTROL = '''#!/bin/bash
if [ "$1 $2" = "show node" ]; then
    echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1"
    echo "   NodeAddr=$FAKE_NODE_ADDR NodeHostName=$3 Version=23.11.4"
    exit 0
fi
echo "$*" >> "$FAKE_OUT/scontrol.log"
'''


def free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (etcd's client and peer ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


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
        env = {"PATH": f"{self.bin}:{os.environ['PATH']}", "HOME": str(self.tmp), "TMPDIR": str(self.scratch),
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": f"n[1-{n}]" if n > 1 else self.nodes[0],
               "SLURM_JOB_NUM_NODES": str(n), "SLURM_NNODES": str(n), "SLURMD_NODENAME": self.nodes[0],
               "SLURM_TASKS_PER_NODE": f"{self.tasks_per_node}(x{n})" if n > 1 else str(self.tasks_per_node),
               "SLURM_NTASKS": str(n * self.tasks_per_node), "PS_PYTHON": str(self.bin / "python"),
               "PS_ETCD_PORT": str(self.etcd_port), "PS_CHECKPOINT_ROOT": str(self.tmp / "checkpoints"),
               "FAKE_OUT": str(self.out), "FAKE_NODES": ",".join(self.nodes),
               "FAKE_TASKS_PER_NODE": str(self.tasks_per_node), "FAKE_NODE_ADDR": "10.11.12.13",
               "PYTHONPATH": str(ROOT)}
        env.update(extra)
        return env

    def start(self, **extra: str) -> subprocess.Popen:
        return subprocess.Popen(["bash", str(SBATCH), str(self.probe)], env=self.env(**extra), cwd=self.tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, *args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SBATCH), str(self.probe), *args], env=self.env(**extra), cwd=self.tmp,
                              capture_output=True, text=True, timeout=60)

    def tasks(self) -> List[List[dict]]:
        """Every task's runs, in task order: the environment (and argv) of each run."""
        return [[json.loads(line) for line in (self.out / f"task-{t}.jsonl").read_text().splitlines()]
                for t in range(len(self.nodes) * self.tasks_per_node)]

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
    assert all(r[0]["argv"] == ["--epochs", "1", "--checkpoint_dir", str(tmp_path / "checkpoints" / "4242")]
               for r in runs)
    config = None
    for t, env in enumerate(envs):
        assert (env["PS_SERVER_REPLICAS"], env["PS_PSERVER_NUM"], env["PS_COORDINATOR"]) == ("2", "2", coordinator)
        role, read = slurm_roles.discover(env), RoleEnv.from_env(env)
        fields = ("role", "pservers", "trainers", "trainer_id", "current_endpoint", "source")
        assert [getattr(role, f) for f in fields] == [getattr(read, f) for f in fields] and role.source == "slurm"
        assert role.pservers == pservers and role.trainers == 2
        if t < 4:
            assert (role.role, role.current_endpoint) == ("PSERVER", (pservers + replicas)[t])
        else:
            assert (role.role, role.trainer_id) == ("TRAINER", t - 4)
        config = resolved(env, role.pservers)
        assert (config.server_replicas, config.replica_endpoints, config.coordinator, config.coordinator_prefix) \
            == (2, ",".join(replicas), coordinator, "/torch-pserver/slurm-4242.0")
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


# --- a real etcd with the recipes' flags ----------------------------------------------------------------

def lease_ttl(url: str) -> int:
    """The TTL etcd grants a lease asked for 1 s (etcd raises it to its minimum)."""
    request = urllib.request.Request(url + "/v3/lease/grant", data=json.dumps({"TTL": 1}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as r:
        return int(json.load(r)["TTL"])


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"etcd exited with {proc.returncode}: {log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if json.load(r).get("health") == "true":
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"etcd did not answer at {url}/health: {log.read_text()[-2000:]}")


@pytest.fixture
def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        from tests.helpers.system import unavailable
        unavailable("not installed: etcd (apt-get install etcd-server)")
    return path


def test_the_kubernetes_etcd_flags_give_1s_leases(tmp_path, etcd_binary):
    command = container(one(build(), "StatefulSet", "ps-etcd")["spec"]["template"]["spec"], "etcd")["command"]
    client, metrics = free_port_pair(), free_port_pair()
    peer = client + 1
    local = {"listen-client-urls": f"http://127.0.0.1:{client}", "advertise-client-urls": f"http://127.0.0.1:{client}",
             "listen-peer-urls": f"http://127.0.0.1:{peer}", "initial-advertise-peer-urls": f"http://127.0.0.1:{peer}",
             "listen-metrics-urls": f"http://127.0.0.1:{metrics}", "data-dir": str(tmp_path / "data")}
    flags = etcd_flags(command)
    assert set(local) <= set(flags)
    flags.update(local, **{"initial-cluster": f"{flags['name']}=http://127.0.0.1:{peer}"})
    log = tmp_path / "etcd.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([etcd_binary, *(f"--{k}={v}" for k, v in flags.items())], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{metrics}", proc, log)  # the probes' port
        assert lease_ttl(f"http://127.0.0.1:{client}") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# srun for a real etcd: the lease TTL the coordinator grants, then the tasks as usual.
LEASE_SRUN = r'''
import json, os, urllib.request
request = urllib.request.Request(os.environ["PS_COORDINATOR"] + "/v3/lease/grant", data=b'{"TTL": 1}',
                                 headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=5) as r:
    ttl = json.load(r)["TTL"]
with open(os.path.join(os.environ["FAKE_OUT"], "lease.json"), "w") as f:
    json.dump({"ttl": int(ttl)}, f)
''' + FAKE_SRUN


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
