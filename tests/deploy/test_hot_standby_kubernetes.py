"""The Kubernetes hot-standby recipe, checked offline: deploy/kubernetes/hot-standby/.

The kustomization is built here in Python (its resources, then its RFC 6902 patches; where
``kubectl`` or ``kustomize`` is installed the result must equal theirs), every object is validated
against the API schemas, and every pod the objects make reads an environment from which
RoleEnv.from_env and resolve_replicas give its place among the 2 pservers and their 2 second
processes; the transpiler gives pod N+i pserver i's shard. With ``etcd`` installed, the recipe's
etcd flags start a real etcd that grants 1 s leases. The Slurm recipe: test_hot_standby_slurm.py.
"""

from __future__ import annotations

import copy
import json
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Dict, List

import kubernetes_validate
import pytest
import yaml

from tests.deploy.hot_standby import (
    COORDINATOR,
    HOT_STANDBY,
    PSERVERS,
    REPLICAS,
    N,
    free_port_pair,
    resolved,
    shards,
)
from tests.deploy.test_kubernetes_manifests import (
    VERSIONS,
    container,
    indexed_job_pods,
    load_entrypoint,
    port_named,
    statefulset_pods,
)
from transpiler import RoleEnv

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
    docs = [
        d
        for resource in k["resources"]
        for d in yaml.safe_load_all((HOT_STANDBY / resource).read_text())
        if d is not None
    ]
    for patch in k.get("patches", []):
        assert set(patch) == {"path", "target"}, (
            f"build() here implements file patches with a target: {patch}"
        )
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
    assert sorted(map(_key, docs)) == sorted(
        [
            ("Service", "ps-pserver"),
            ("StatefulSet", "ps-pserver"),
            ("Job", "ps-trainer"),
            ("Service", "ps-etcd"),
            ("StatefulSet", "ps-etcd"),
            ("PodDisruptionBudget", "ps-pserver"),
        ]
    )
    # Neither the Secret nor the checkpoint claim: deleting these objects between runs keeps the checkpoints.
    assert not {"Secret", "PersistentVolumeClaim"} & {d["kind"] for d in docs}
    if shutil.which("kustomize"):
        command = ["kustomize", "build"]
    elif shutil.which("kubectl"):
        command = ["kubectl", "kustomize"]
    else:
        return  # the Python build above is the check
    r = subprocess.run(
        [*command, "--load-restrictor", "LoadRestrictionsNone", str(HOT_STANDBY)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    theirs = sorted(yaml.safe_load_all(r.stdout), key=_key)
    assert theirs == sorted(docs, key=_key)


@pytest.mark.parametrize("version", VERSIONS)
def test_hot_standby_objects_match_the_kubernetes_api(version):
    for doc in build():
        kubernetes_validate.validate(doc, version, strict=True)


def test_patches_change_only_the_hot_standby_settings():
    base = {
        _key(d): d
        for name in ("pserver-statefulset.yaml", "trainer-job.yaml")
        for d in yaml.safe_load_all((HOT_STANDBY.parent / name).read_text())
    }
    docs = build()
    for key, original in base.items():
        patched = one(docs, *key)
        spec, before = patched["spec"]["template"]["spec"], original["spec"]["template"]["spec"]
        env, old_env = container(spec)["env"], container(before)["env"]
        assert env[: len(old_env)] == old_env, "the base variables stay as they are"
        names = [v["name"] for v in env]
        assert len(names) == len(set(names)), f"a variable set twice in {key}: {names}"
        rest = copy.deepcopy(patched)
        container(rest["spec"]["template"]["spec"])["env"] = old_env
        rest["spec"]["template"]["spec"].pop("affinity", None)
        if key[0] == "StatefulSet":
            rest["spec"]["replicas"] = original["spec"]["replicas"]
        assert rest == original, f"{key}: the patch changes more than env, affinity and replicas"


# --- the roles every pod finds ------------------------------------------------------------------------


def test_every_pod_finds_its_process_and_the_replicas(monkeypatch):
    docs = build()
    sts, job = one(docs, "StatefulSet", "ps-pserver"), one(docs, "Job", "ps-trainer")
    pserver_pods, trainer_pods = statefulset_pods(sts), indexed_job_pods(job)
    assert sts["spec"]["replicas"] == 2 * N == 2 * int(pserver_pods[0]["PS_PSERVER_NUM"])
    assert (
        PSERVERS[0] == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}:"
        f"{port_named(sts['spec']['template']['spec'], 'grpc')}"
    )
    processes = PSERVERS + REPLICAS
    config = None
    for i, env in enumerate(pserver_pods):
        role = RoleEnv.from_env(env)
        assert (role.role, role.source, role.current_endpoint) == ("PSERVER", "kubernetes", processes[i])
        assert role.pservers == PSERVERS and role.trainers == len(trainer_pods)
        config = resolved(env, role.pservers)
        assert (config.server_replicas, config.replica_endpoints, config.coordinator) == (
            2,
            ",".join(REPLICAS),
            COORDINATOR,
        )
        assert config.coordinator_prefix is None  # every pod the same default: /torch-pserver/<layout digest>
        # The image's entry point holds each pod until its own name resolves, second processes included.
        assert load_entrypoint().name_to_wait_for(role) == processes[i].rpartition(":")[0]
    for i, env in enumerate(trainer_pods):
        role = RoleEnv.from_env(env)
        assert (role.role, role.trainer_id, role.pservers) == ("TRAINER", i, PSERVERS)
        assert (resolved(env, role.pservers).replica_endpoints, resolved(env, role.pservers).coordinator) == (
            ",".join(REPLICAS),
            COORDINATOR,
        )
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
    assert (
        COORDINATOR
        == f"http://{svc['metadata']['name']}:{svc_port['port']}"
        == flags["advertise-client-urls"]
    )
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
    labels = {
        key: one(docs, *key)["spec"]["template"]["metadata"]["labels"]
        for key in (("StatefulSet", "ps-pserver"), ("Job", "ps-trainer"), ("StatefulSet", "ps-etcd"))
    }
    selectors = {
        "pserver Service": (one(docs, "Service", "ps-pserver")["spec"]["selector"], "ps-pserver"),
        "etcd Service": (one(docs, "Service", "ps-etcd")["spec"]["selector"], "ps-etcd"),
        "disruption budget": (
            one(docs, "PodDisruptionBudget", "ps-pserver")["spec"]["selector"]["matchLabels"],
            "ps-pserver",
        ),
    }
    for what, (selector, owner) in selectors.items():
        for (kind, name), pod_labels in labels.items():
            selected = selector.items() <= pod_labels.items()
            assert selected == (name == owner and kind == "StatefulSet"), f"{what} and the {name} pods"
    assert one(docs, "PodDisruptionBudget", "ps-pserver")["spec"]["maxUnavailable"] == 1
    term = one(docs, "StatefulSet", "ps-pserver")["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ][0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"].items() <= labels[("StatefulSet", "ps-pserver")].items()


# --- a real etcd with the recipes' flags ----------------------------------------------------------------


def lease_ttl(url: str) -> int:
    """The TTL etcd grants a lease asked for 1 s (etcd raises it to its minimum)."""
    request = urllib.request.Request(
        url + "/v3/lease/grant",
        data=json.dumps({"TTL": 1}).encode(),
        headers={"Content-Type": "application/json"},
    )
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


def test_the_kubernetes_etcd_flags_give_1s_leases(tmp_path, etcd_binary):
    command = container(one(build(), "StatefulSet", "ps-etcd")["spec"]["template"]["spec"], "etcd")["command"]
    client, metrics = free_port_pair(), free_port_pair()
    peer = client + 1
    local = {
        "listen-client-urls": f"http://127.0.0.1:{client}",
        "advertise-client-urls": f"http://127.0.0.1:{client}",
        "listen-peer-urls": f"http://127.0.0.1:{peer}",
        "initial-advertise-peer-urls": f"http://127.0.0.1:{peer}",
        "listen-metrics-urls": f"http://127.0.0.1:{metrics}",
        "data-dir": str(tmp_path / "data"),
    }
    flags = etcd_flags(command)
    assert set(local) <= set(flags)
    flags.update(local, **{"initial-cluster": f"{flags['name']}=http://127.0.0.1:{peer}"})
    log = tmp_path / "etcd.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [etcd_binary, *(f"--{k}={v}" for k, v in flags.items())],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
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
