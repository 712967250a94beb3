"""deploy/kubernetes/ checked offline: every manifest against the Kubernetes API schemas
(kubernetes_validate, strict: unknown fields are errors), and, for every pod the manifests make,
the environment Kubernetes (or the TFJob operator) gives it read by RoleEnv.from_env. Also the
image's entry point (deploy/entrypoint.py), which holds a pserver until its own name resolves."""

from __future__ import annotations

import copy
import importlib.util
import json
from typing import Dict, List

import kubernetes_validate
import pytest
import yaml

from psproto.security import Security
from tests.helpers import paths
from transpiler import RoleEnv

ROOT = paths.REPO
MANIFESTS = ROOT / "deploy" / "kubernetes"
# The oldest Kubernetes the manifests ask for (backoffLimitPerIndex, podReplacementPolicy) and the newest
# schema.
VERSIONS = ("1.29", kubernetes_validate.latest_version())
HEALTH_SERVICE = "psproto.ParameterServer"  # the pserver's gRPC service, as its health service names it
TFJOB_REPLICA_TYPES = {"PS", "Worker", "Chief", "Master", "Evaluator"}


def documents() -> Dict[str, List[dict]]:
    return {
        path.name: list(yaml.safe_load_all(path.read_text())) for path in sorted(MANIFESTS.glob("*.yaml"))
    }


def one(kind: str, name: str = None) -> dict:
    found = [
        d
        for docs in documents().values()
        for d in docs
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(pod_spec: dict, name: str = None) -> dict:
    containers = (
        pod_spec["containers"] if name is None else [c for c in pod_spec["containers"] if c["name"] == name]
    )
    assert len(containers) == 1
    return containers[0]


def env_of(pod_spec: dict, pod_ip: str, name: str = None) -> Dict[str, str]:
    """What the container's env list gives (fieldRef status.podIP -> pod_ip; no other references used)."""
    env = {}
    for var in container(pod_spec, name).get("env", []):
        if "value" in var:
            assert "$(" not in var["value"], "dependent variables are not simulated here"
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, var
            env[var["name"]] = pod_ip
    return env


def port_named(pod_spec: dict, port_name: str, name: str = None) -> int:
    ports = [p["containerPort"] for p in container(pod_spec, name).get("ports", []) if p["name"] == port_name]
    assert len(ports) == 1, f"no single container port named {port_name}"
    return ports[0]


def statefulset_pods(sts: dict) -> List[Dict[str, str]]:
    """Pod i of a StatefulSet: HOSTNAME <statefulset>-<i>, as Kubernetes sets it, plus the manifest's env."""
    spec = sts["spec"]["template"]["spec"]
    return [
        {**env_of(spec, f"10.244.1.{10 + i}"), "HOSTNAME": f"{sts['metadata']['name']}-{i}"}
        for i in range(sts["spec"]["replicas"])
    ]


def indexed_job_pods(job: dict) -> List[Dict[str, str]]:
    """Pod i of an Indexed Job: JOB_COMPLETION_INDEX=i and HOSTNAME <job>-<i>, as Kubernetes sets them."""
    assert job["spec"]["completionMode"] == "Indexed"
    spec = job["spec"]["template"]["spec"]
    return [
        {
            **env_of(spec, f"10.244.2.{10 + i}"),
            "JOB_COMPLETION_INDEX": str(i),
            "HOSTNAME": f"{job['metadata']['name']}-{i}",
        }
        for i in range(job["spec"]["completions"])
    ]


def tfjob_pods(tfjob: dict, namespace: str = "default") -> Dict[str, List[Dict[str, str]]]:
    """Every replica's env, TF_CONFIG built as the training operator's genClusterSpec/genTFConfigJSONStr
    do."""
    name, specs = tfjob["metadata"]["name"], tfjob["spec"]["tfReplicaSpecs"]
    cluster = {}
    for rtype, spec in specs.items():
        if rtype == "Evaluator":
            continue
        ports = [
            p["containerPort"]
            for c in spec["template"]["spec"]["containers"]
            if c["name"] == "tensorflow"
            for p in c.get("ports", [])
            if p["name"] == "tfjob-port"
        ]
        port = ports[0] if ports else 2222
        cluster[rtype.lower()] = [
            f"{name}-{rtype.lower()}-{i}.{namespace}.svc:{port}" for i in range(spec.get("replicas", 1))
        ]
    pods = {}
    for rtype, spec in specs.items():
        pods[rtype] = [
            {
                **env_of(spec["template"]["spec"], f"10.244.3.{i}", "tensorflow"),
                "HOSTNAME": f"{name}-{rtype.lower()}-{i}",
                "TF_CONFIG": json.dumps(
                    {"cluster": cluster, "task": {"type": rtype.lower(), "index": i}, "environment": "cloud"},
                    separators=(",", ":"),
                ),
            }
            for i in range(spec.get("replicas", 1))
        ]
    return pods


# --- the API schemas ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", sorted(p.name for p in MANIFESTS.glob("*.yaml")))
def test_manifests_match_the_kubernetes_api(path, version):
    docs = documents()[path]
    assert docs and all(d and "kind" in d for d in docs)
    for doc in docs:
        if doc["kind"] == "TFJob":  # a custom resource: no built-in schema (see the TFJob test)
            continue
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_tfjob_structure_and_pod_templates(version):
    tfjob = one("TFJob")
    assert tfjob["apiVersion"] == "kubeflow.org/v1"
    spec = tfjob["spec"]
    assert set(spec) <= {"runPolicy", "successPolicy", "tfReplicaSpecs", "enableDynamicWorker"}
    assert not spec.get("enableDynamicWorker"), "a sparse TF_CONFIG lists no other workers"
    assert spec.get("successPolicy") in (None, "", "AllWorkers")
    assert spec["runPolicy"].get("cleanPodPolicy") in (None, "All", "Running", "None")
    assert {"PS", "Worker"} <= set(spec["tfReplicaSpecs"]) <= TFJOB_REPLICA_TYPES
    for rtype, replica in spec["tfReplicaSpecs"].items():
        assert set(replica) <= {"replicas", "restartPolicy", "template"}
        assert isinstance(replica["replicas"], int) and replica["replicas"] >= 1
        assert replica["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        # The operator validates the template as a PodTemplateSpec: so do we, through the PodTemplate kind.
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{tfjob['metadata']['name']}-{rtype.lower()}"},
                "template": replica["template"],
            },
            version,
            strict=True,
        )
        # The operator takes the port of container "tensorflow"'s "tfjob-port" for TF_CONFIG.
        assert port_named(replica["template"]["spec"], "tfjob-port", "tensorflow") > 0


# --- the roles every pod finds ---------------------------------------------------------------------


def test_statefulset_and_indexed_job_pods_find_their_roles():
    sts, job = one("StatefulSet"), one("Job", "ps-trainer")
    pserver_pods, trainer_pods = statefulset_pods(sts), indexed_job_pods(job)
    service, port = sts["spec"]["serviceName"], port_named(sts["spec"]["template"]["spec"], "grpc")
    endpoints = [f"{sts['metadata']['name']}-{i}.{service}:{port}" for i in range(sts["spec"]["replicas"])]
    for i, env in enumerate(pserver_pods):
        role = RoleEnv.from_env(env)
        assert (role.role, role.source, role.current_endpoint) == ("PSERVER", "kubernetes", endpoints[i])
        assert role.pservers == endpoints and role.trainers == len(trainer_pods)
    for i, env in enumerate(trainer_pods):
        role = RoleEnv.from_env(env)
        assert (role.role, role.source, role.trainer_id, role.trainers) == (
            "TRAINER",
            "kubernetes",
            i,
            len(trainer_pods),
        )
        assert role.pservers == endpoints and not role.collective
    assert job["spec"]["parallelism"] == job["spec"]["completions"], (
        "every trainer runs at once (sync barriers)"
    )


def test_pserver_names_resolve_through_the_headless_service():
    sts, svc = one("StatefulSet"), one("Service")
    template = sts["spec"]["template"]
    assert svc["metadata"]["name"] == sts["spec"]["serviceName"]
    assert svc["spec"]["clusterIP"] == "None", "per-pod DNS names need a headless Service"
    assert svc["spec"]["publishNotReadyAddresses"] is True, "a pserver binds its name before it is ready"
    assert svc["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert (
        not svc["spec"]["selector"].items()
        <= one("Job", "ps-trainer")["spec"]["template"]["metadata"]["labels"].items()
    )
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    for name in ("grpc", "health", "metrics"):
        assert ports[name]["port"] == port_named(template["spec"], name) and ports[name]["targetPort"] == name


def test_probes_ask_the_unauthenticated_health_port_and_metrics_are_scraped():
    for template in (
        one("StatefulSet")["spec"]["template"],
        one("TFJob")["spec"]["tfReplicaSpecs"]["PS"]["template"],
    ):
        spec = template["spec"]
        pserver = container(spec)
        env = env_of(spec, "10.244.0.1")
        health = int(env["PS_HEALTH_PORT"])
        assert health == port_named(spec, "health")
        probes = {k: v for k, v in pserver.items() if k.endswith("Probe")}
        assert "livenessProbe" in probes
        for kind, probe in probes.items():
            assert set(probe["grpc"]) <= {"port", "service"} and probe["grpc"]["port"] == health, kind
            assert probe["grpc"].get("service", "") in ("", HEALTH_SERVICE), kind
        metrics = int(env["PS_METRICS_PORT"])
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == metrics == port_named(spec, "metrics")
    statefulset_probes = container(one("StatefulSet")["spec"]["template"]["spec"])
    assert statefulset_probes["readinessProbe"]["grpc"]["service"] == HEALTH_SERVICE
    # Under the operator a pod's name resolves only once it is ready, and a pserver binds its name first.
    assert "readinessProbe" not in container(one("TFJob")["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"])
    assert "startupProbe" not in container(one("TFJob")["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"])


def test_tfjob_pods_find_their_roles_from_tf_config():
    tfjob = one("TFJob")
    pods = tfjob_pods(tfjob)
    name, port = (
        tfjob["metadata"]["name"],
        port_named(tfjob["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"], "tfjob-port", "tensorflow"),
    )
    endpoints = [f"{name}-ps-{i}.default.svc:{port}" for i in range(len(pods["PS"]))]
    for i, env in enumerate(pods["PS"]):
        role = RoleEnv.from_env(env)
        assert (role.role, role.source, role.current_endpoint, role.pservers) == (
            "PSERVER",
            "kubeflow",
            endpoints[i],
            endpoints,
        )
        assert role.trainers == len(pods["Worker"])
    assert [RoleEnv.from_env(env).trainer_id for env in pods["Worker"]] == list(range(len(pods["Worker"])))
    # A Chief added to the job is trainer 0 and shifts the workers.
    with_chief = copy.deepcopy(tfjob)
    with_chief["spec"]["tfReplicaSpecs"]["Chief"] = {
        **copy.deepcopy(tfjob["spec"]["tfReplicaSpecs"]["Worker"]),
        "replicas": 1,
    }
    pods = tfjob_pods(with_chief)
    assert RoleEnv.from_env(pods["Chief"][0]).trainer_id == 0
    assert [RoleEnv.from_env(env).trainer_id for env in pods["Worker"]] == [1, 2]
    assert {RoleEnv.from_env(env).trainers for env in pods["PS"]} == {3}


def test_every_role_runs_the_same_script_and_flags():
    templates = [
        one("StatefulSet")["spec"]["template"],
        one("Job", "ps-trainer")["spec"]["template"],
        *(r["template"] for r in one("TFJob")["spec"]["tfReplicaSpecs"].values()),
    ]
    commands = {
        tuple(container(t["spec"]).get("command", ())) + tuple(container(t["spec"])["args"])
        for t in templates
    }
    assert len(commands) == 1, "pservers and trainers must transpile the same program with the same flags"
    assert not any("command" in container(t["spec"]) for t in templates), "keep the image's entry point"


def test_trainers_restart_like_ps_launch_max_restarts():
    job = one("Job", "ps-trainer")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["backoffLimitPerIndex"] >= 1 and spec["maxFailedIndexes"] == 0
    assert pod["restartPolicy"] == "Never" and spec["podReplacementPolicy"] == "Failed"
    env = env_of(pod, "10.244.2.1")
    assert int(env["PS_TRAINER_NUM"]) == spec["completions"]
    sts_env = env_of(one("StatefulSet")["spec"]["template"]["spec"], "10.244.1.1")
    assert (
        int(sts_env["PS_PSERVER_NUM"]) == one("StatefulSet")["spec"]["replicas"] == int(env["PS_PSERVER_NUM"])
    )
    assert sts_env["PS_TRAINER_NUM"] == env["PS_TRAINER_NUM"]
    assert one("StatefulSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60


def test_secret_and_volumes(tmp_path):
    secret, pvc = one("Secret"), one("PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], (
        "every pserver reads every pserver's checkpoint part"
    )
    templates = [
        one("StatefulSet")["spec"]["template"],
        one("Job", "ps-trainer")["spec"]["template"],
        *(r["template"] for r in one("TFJob")["spec"]["tfReplicaSpecs"].values()),
    ]
    for template in templates:
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["name"]: m for m in container(spec)["volumeMounts"]}
        token_file = env_of(spec, "10.244.0.1")["PS_AUTH_TOKEN_FILE"]
        mount = next(m for m in mounts.values() if token_file.startswith(m["mountPath"] + "/"))
        assert mount.get("readOnly") is True
        source = volumes[mount["name"]]["secret"]
        assert source["secretName"] == secret["metadata"]["name"]
        assert token_file[len(mount["mountPath"]) + 1 :] in secret["stringData"]
        assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True
    # Applied unchanged, the Secret's token is empty, and both roles refuse it rather than run open.
    token = tmp_path / "token"
    token.write_text(secret["stringData"]["token"])
    with pytest.raises(ValueError, match="is empty; an empty token would let anyone in"):
        Security.from_env({"PS_AUTH_TOKEN_FILE": str(token)})


# --- the entry point -------------------------------------------------------------------------------


def load_entrypoint():
    spec = importlib.util.spec_from_file_location("ps_entrypoint", ROOT / "deploy" / "entrypoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_entrypoint_waits_for_a_pservers_own_name():
    entry = load_entrypoint()
    pserver = RoleEnv.from_env(statefulset_pods(one("StatefulSet"))[1])
    assert entry.name_to_wait_for(pserver) == "ps-pserver-1.ps-pserver"
    assert entry.name_to_wait_for(RoleEnv.from_env(indexed_job_pods(one("Job", "ps-trainer"))[0])) is None
    assert (
        entry.name_to_wait_for(RoleEnv("PSERVER", ["10.0.0.1:6170"], 1, current_endpoint="10.0.0.1:6170"))
        is None
    )
    assert entry.name_to_wait_for(None) is None
    # Not yet published, then a stale address from the pod's previous life, then this pod's.
    answers = iter([[], ["10.244.9.9"], ["10.244.1.11"]])
    clock = FakeClock()
    asked = []

    def resolver(host):
        asked.append(host)
        return next(answers)

    assert entry.wait_for_name(
        "ps-pserver-1.ps-pserver", "10.244.1.11", 30, resolver, clock, clock.sleep
    ) == ["10.244.1.11"]
    assert asked == ["ps-pserver-1.ps-pserver"] * 3 and clock.now == 2.0
    # Without POD_IP any answer will do; a name that never resolves fails at the deadline, naming it.
    assert entry.wait_for_name("h", None, 5, lambda h: ["10.0.0.3"], clock, clock.sleep) == ["10.0.0.3"]
    clock = FakeClock()
    with pytest.raises(
        TimeoutError, match="ps-pserver-1.ps-pserver did not resolve to 10.244.1.11 within 5 s"
    ):
        entry.wait_for_name("ps-pserver-1.ps-pserver", "10.244.1.11", 5, lambda h: [], clock, clock.sleep)
    assert clock.now == 5.0


def test_entrypoint_runs_the_command(monkeypatch, capsys):
    entry = load_entrypoint()
    ran = []
    monkeypatch.setattr(entry.os, "execvp", lambda file, args: ran.append(args))
    trainer = indexed_job_pods(one("Job", "ps-trainer"))[1]
    assert entry.main(["python", "train.py"], trainer) == 0 and ran == [["python", "train.py"]]
    assert entry.main(["python", "train.py"], {}) == 0 and len(ran) == 2  # a local run
    pserver = {**statefulset_pods(one("StatefulSet"))[0], "POD_IP": "10.244.1.10", "PS_RESOLVE_TIMEOUT": "0"}
    monkeypatch.setattr(
        entry, "resolve", lambda host: ["10.244.1.10"] if host == "ps-pserver-0.ps-pserver" else []
    )
    assert entry.main(["python", "train.py"], pserver) == 0 and len(ran) == 3
    assert entry.main(["python", "train.py"], {**pserver, "POD_IP": "10.244.1.99"}) == 1 and len(ran) == 3
    assert "did not resolve to 10.244.1.99" in capsys.readouterr().err
    assert entry.main(["python", "train.py"], {**trainer, "JOB_COMPLETION_INDEX": "9"}) == 2
    assert "JOB_COMPLETION_INDEX=9 is out of range" in capsys.readouterr().err
    assert entry.main(["python", "train.py"], {**pserver, "PS_RESOLVE_TIMEOUT": "soon"}) == 2
    assert "PS_RESOLVE_TIMEOUT must be a number of seconds >= 0, got 'soon'" in capsys.readouterr().err
    assert entry.main([], trainer) == 2 and len(ran) == 3


def test_the_reshard_job_grows_the_statefulset_by_its_next_pod():
    """ps-reshard's Job asks for the pservers of the StatefulSet scaled up by one: the list its new pod
    reads from its environment (it then waits for that change), on the volume the pservers keep their
    checkpoints (and the layout record) on."""
    sts, job = one("StatefulSet"), one("Job", "ps-reshard")
    sts_pod, job_pod = sts["spec"]["template"]["spec"], job["spec"]["template"]["spec"]
    args = container(job_pod)["args"]
    assert args[0] == "ps-reshard"
    asked = args[args.index("--pservers") + 1].split(",")
    grown = sts["spec"]["replicas"] + 1
    new_pod = RoleEnv.from_env({**env_of(sts_pod, "10.244.1.9"), "HOSTNAME": f"ps-pserver-{grown - 1}"})
    assert new_pod.is_pserver and new_pod.pservers == asked and len(asked) == grown
    assert new_pod.current_endpoint == asked[-1]
    mount = lambda pod: next(m for m in container(pod)["volumeMounts"] if m["name"] == "checkpoints")  # noqa: E731
    assert mount(job_pod) == mount(sts_pod)
    claim = lambda pod: next(v for v in pod["volumes"] if v["name"] == "checkpoints")  # noqa: E731
    assert claim(job_pod) == claim(sts_pod)
    checkpoint_dir = container(sts_pod)["args"][container(sts_pod)["args"].index("--checkpoint_dir") + 1]
    assert args[args.index("--checkpoint_dir") + 1] == checkpoint_dir
