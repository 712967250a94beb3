"""RoleEnv.from_env in the environments cluster engines really give: Kubeflow's TF_CONFIG, Kubernetes
StatefulSet and Indexed Job pods, Slurm steps (compressed, unsorted node lists; heterogeneous jobs),
torchrun; the order of precedence among them; and the errors that name the variable at fault."""

from __future__ import annotations

import json
import re

import pytest

from transpiler import RoleEnv
from transpiler.roles import SOURCES, discover
from transpiler.roles.role_env import NodeEnv

EPS = "10.0.0.1:6170,10.0.0.2:6170"


def tf_config(kind, index, ps=2, workers=2, chief=None, name="ctr", namespace="default", port=6170):
    """TF_CONFIG as the TFJob operator builds it: <job>-<type>-<i>.<namespace>.svc:<port>, compact JSON."""
    cluster = {}
    for rtype, n in (
        ("chief", 1 if chief == "chief" else 0),
        ("master", 1 if chief == "master" else 0),
        ("ps", ps),
        ("worker", workers),
    ):
        if n:
            cluster[rtype] = [f"{name}-{rtype}-{i}.{namespace}.svc:{port}" for i in range(n)]
    return json.dumps(
        {"cluster": cluster, "task": {"type": kind, "index": index}, "environment": "cloud"},
        separators=(",", ":"),
    )


def ctr_eps(kind, n, port=6170):
    return [f"ctr-{kind}-{i}.default.svc:{port}" for i in range(n)]


# A pod: what Kubernetes sets anyway, plus the manifests' variables.
POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "POD_IP": "10.244.1.7"}
SERVICE = {
    "PS_PSERVER_SERVICE": "ps-pserver",
    "PS_PSERVER_NUM": "3",
    "PS_PSERVER_PORT": "6170",
    "PS_TRAINER_NUM": "2",
}
STS_EPS = [f"ps-pserver-{i}.ps-pserver:6170" for i in range(3)]

# A Slurm step: srun -n5 over gpu12, gpu03, gpu04 (listed unsorted, as Slurm may), 2+2+1 tasks.
STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "gpu[03-04,12]",
    "SLURM_STEP_NODELIST": "gpu[12,03-04]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
    "SLURM_NTASKS": "5",
    "SLURM_STEP_NUM_TASKS": "5",
    "PS_PSERVER_NUM": "3",
}
SLURM_EPS = ["gpu12:6170", "gpu12:6171", "gpu03:6170"]


def task(procid, node, localid, **more):
    return {
        **STEP,
        "SLURM_PROCID": str(procid),
        "SLURMD_NODENAME": node,
        "SLURM_LOCALID": str(localid),
        **more,
    }


# A heterogeneous job: component 0 (pservers) 2+1 tasks on cpu2, cpu1; component 1 (trainers) 2+2 on gpu[1-2].
HET = {
    "SLURM_JOB_ID": "77",
    "SLURM_HET_SIZE": "2",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "cpu[2,1]",
    "SLURM_TASKS_PER_NODE_HET_GROUP_0": "2,1",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "gpu[1-2]",
    "SLURM_TASKS_PER_NODE_HET_GROUP_1": "2(x2)",
}
HET_EPS = ["cpu2:6170", "cpu2:6171", "cpu1:6170"]

# torchrun --nnodes 2 --nproc-per-node 2: local rank 1 of node 1.
TORCHRUN = {
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "RANK": "3",
    "WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "ROLE_RANK": "3",
    "ROLE_WORLD_SIZE": "4",
    "ROLE_NAME": "default",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "ctr",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}

PS, TR = "PSERVER", "TRAINER"

FOUND = [
    # --- Kubeflow TFJob: TF_CONFIG -------------------------------------------------------------
    (
        "tfjob-ps",
        {**POD, "TF_CONFIG": tf_config("ps", 1)},
        RoleEnv(PS, ctr_eps("ps", 2), 2, current_endpoint="ctr-ps-1.default.svc:6170"),
        "kubeflow",
    ),
    (
        "tfjob-worker",
        {**POD, "TF_CONFIG": tf_config("worker", 1)},
        RoleEnv(TR, ctr_eps("ps", 2), 2, trainer_id=1),
        "kubeflow",
    ),
    (
        "tfjob-chief-is-trainer-0",
        {"TF_CONFIG": tf_config("chief", 0, chief="chief")},
        RoleEnv(TR, ctr_eps("ps", 2), 3, trainer_id=0),
        "kubeflow",
    ),
    (
        "tfjob-workers-after-chief",
        {"TF_CONFIG": tf_config("worker", 1, chief="chief")},
        RoleEnv(TR, ctr_eps("ps", 2), 3, trainer_id=2),
        "kubeflow",
    ),
    (
        "tfjob-master",
        {"TF_CONFIG": tf_config("master", 0, chief="master", workers=1)},
        RoleEnv(TR, ctr_eps("ps", 2), 2, trainer_id=0),
        "kubeflow",
    ),
    (
        "tfjob-role-agrees",
        {"TF_CONFIG": tf_config("ps", 0), "TRAINING_ROLE": "pserver", "PS_TRAINER_NUM": "2"},
        RoleEnv(PS, ctr_eps("ps", 2), 2, current_endpoint="ctr-ps-0.default.svc:6170"),
        "kubeflow",
    ),
    (
        "tfjob-collective-meets-at-worker-0",
        {"TF_CONFIG": tf_config("worker", 1, ps=0)},
        RoleEnv(TR, [], 2, trainer_id=1, node=NodeEnv(0, 1, "ctr-worker-0.default.svc", 6170, 1, 2)),
        "kubeflow",
    ),
    (
        "tfjob-torchrun-in-worker",
        {"TF_CONFIG": tf_config("worker", 0), **TORCHRUN},
        RoleEnv(TR, ctr_eps("ps", 2), 2, trainer_id=0, node=NodeEnv(1, 2, "node0", 29500, 1, 2)),
        "kubeflow",
    ),
    # --- Kubernetes: StatefulSet pservers, Indexed Job trainers ----------------------------------
    (
        "sts-pserver",
        {**POD, **SERVICE, "HOSTNAME": "ps-pserver-2"},
        RoleEnv(PS, STS_EPS, 2, current_endpoint="ps-pserver-2.ps-pserver:6170"),
        "kubernetes",
    ),
    (
        "sts-pserver-namespaced",
        {
            **POD,
            **SERVICE,
            "PS_PSERVER_SERVICE": "ps-pserver.team-a",
            "PS_PSERVER_STATEFULSET": "ps-pserver",
            "TRAINING_ROLE": "PSERVER",
            "HOSTNAME": "ps-pserver-0",
            "PS_PSERVER_PORT": "",
        },
        RoleEnv(
            PS,
            [f"ps-pserver-{i}.ps-pserver.team-a:6170" for i in range(3)],
            2,
            current_endpoint="ps-pserver-0.ps-pserver.team-a:6170",
        ),
        "kubernetes",
    ),
    (
        "sts-name-with-digits",
        {**SERVICE, "PS_PSERVER_NUM": "11", "PS_PSERVER_PORT": "7000", "HOSTNAME": "ctr-ps-v2-10"},
        RoleEnv(
            PS,
            [f"ctr-ps-v2-{i}.ps-pserver:7000" for i in range(11)],
            2,
            current_endpoint="ctr-ps-v2-10.ps-pserver:7000",
        ),
        "kubernetes",
    ),
    (
        "sts-pserver-explicit-list",
        {
            "TRAINING_ROLE": "PSERVER",
            "PS_PSERVER_STATEFULSET": "ps",
            "HOSTNAME": "ps-1",
            "PADDLE_PSERVERS_IP_PORT_LIST": EPS,
            "PADDLE_TRAINERS_NUM": "2",
        },
        RoleEnv(PS, EPS.split(","), 2, current_endpoint="10.0.0.2:6170"),
        "kubernetes",
    ),
    (
        "indexed-job-pserver",
        {**SERVICE, "TRAINING_ROLE": "PSERVER", "JOB_COMPLETION_INDEX": "1", "HOSTNAME": "ps-pserver-1"},
        RoleEnv(PS, STS_EPS, 2, current_endpoint="ps-pserver-1.ps-pserver:6170"),
        "kubernetes",
    ),
    (
        "indexed-job-trainer",
        {
            **POD,
            **SERVICE,
            "PS_PSERVER_STATEFULSET": "ps-pserver",
            "TRAINING_ROLE": "TRAINER",
            "JOB_COMPLETION_INDEX": "1",
            "HOSTNAME": "ps-trainer-1",
        },
        RoleEnv(TR, STS_EPS, 2, trainer_id=1),
        "kubernetes",
    ),
    (
        "indexed-job-trainer-role-from-index",
        {
            **SERVICE,
            "PS_PSERVER_STATEFULSET": "ps-pserver",
            "JOB_COMPLETION_INDEX": "0",
            "HOSTNAME": "ps-trainer-0",
        },
        RoleEnv(TR, STS_EPS, 2, trainer_id=0),
        "kubernetes",
    ),
    (
        "indexed-job-trainer-explicit-list",
        {"JOB_COMPLETION_INDEX": "1", "PADDLE_PSERVERS_IP_PORT_LIST": EPS, "PS_TRAINER_NUM": "2"},
        RoleEnv(TR, EPS.split(","), 2, trainer_id=1),
        "kubernetes",
    ),
    (
        "indexed-job-collective",
        {"TRAINING_ROLE": "TRAINER", "JOB_COMPLETION_INDEX": "1", "PADDLE_TRAINERS_NUM": "2"},
        RoleEnv(TR, [], 2, trainer_id=1, node=NodeEnv(0, 1, None, None, 1, 2)),
        "kubernetes",
    ),
    (
        "indexed-job-runs-torchrun",
        {
            **SERVICE,
            "PS_PSERVER_STATEFULSET": "ps-pserver",
            "TRAINING_ROLE": "TRAINER",
            "JOB_COMPLETION_INDEX": "1",
            **TORCHRUN,
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "RANK": "1",
            "WORLD_SIZE": "2",
        },
        RoleEnv(TR, STS_EPS, 2, trainer_id=1, node=NodeEnv(1, 2, "node0", 29500, 1, 2)),
        "kubernetes",
    ),
    # --- Slurm: the first PS_PSERVER_NUM tasks are pservers -------------------------------------
    (
        "slurm-pserver-first-slot",
        task(0, "gpu12", 0),
        RoleEnv(PS, SLURM_EPS, 2, current_endpoint="gpu12:6170"),
        "slurm",
    ),
    (
        "slurm-pserver-second-slot",
        task(1, "gpu12", 1),
        RoleEnv(PS, SLURM_EPS, 2, current_endpoint="gpu12:6171"),
        "slurm",
    ),
    (
        "slurm-pserver-next-node",
        task(2, "gpu03", 0),
        RoleEnv(PS, SLURM_EPS, 2, current_endpoint="gpu03:6170"),
        "slurm",
    ),
    ("slurm-trainer-shares-node", task(3, "gpu03", 1), RoleEnv(TR, SLURM_EPS, 2, trainer_id=0), "slurm"),
    (
        "slurm-trainer",
        task(4, "gpu04", 0, TRAINING_ROLE="TRAINER"),
        RoleEnv(TR, SLURM_EPS, 2, trainer_id=1),
        "slurm",
    ),
    (
        "slurm-job-lists",
        {
            **{k: v for k, v in task(1, "n2", 0).items() if "STEP" not in k},
            "SLURM_JOB_NODELIST": "n[3,2,1]",
            "SLURM_TASKS_PER_NODE": "1(x3)",
            "SLURM_NTASKS": "3",
            "PS_PSERVER_NUM": "2",
            "PS_PSERVER_PORT": "7100",
        },
        RoleEnv(PS, ["n3:7100", "n2:7100"], 1, current_endpoint="n2:7100"),
        "slurm",
    ),
    (
        "slurm-host-suffix",
        task(0, "gpu12", 0, PS_SLURM_HOST_SUFFIX="-ib"),
        RoleEnv(PS, [ep.replace(":", "-ib:") for ep in SLURM_EPS], 2, current_endpoint="gpu12-ib:6170"),
        "slurm",
    ),
    (
        "slurm-multi-bracket",
        {
            "SLURM_PROCID": "1",
            "SLURM_STEP_NODELIST": "rack[2,1]-n[01-02]",
            "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
            "SLURM_NTASKS": "4",
            "PS_PSERVER_NUM": "2",
            "SLURMD_NODENAME": "rack2-n02",
        },
        RoleEnv(PS, ["rack2-n01:6170", "rack2-n02:6170"], 2, current_endpoint="rack2-n02:6170"),
        "slurm",
    ),
    (
        "slurm-collective",
        task(2, "gpu03", 0, PS_PSERVER_NUM="0", MASTER_ADDR="gpu12", MASTER_PORT="29500"),
        RoleEnv(TR, [], 5, trainer_id=2, node=NodeEnv(0, 1, "gpu12", 29500, 2, 5)),
        "slurm",
    ),
    (
        "slurm-task-runs-torchrun",
        {
            **task(4, "gpu04", 0),
            **TORCHRUN,
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "RANK": "1",
            "WORLD_SIZE": "2",
        },
        RoleEnv(TR, SLURM_EPS, 2, trainer_id=1, node=NodeEnv(1, 2, "node0", 29500, 1, 2)),
        "slurm",
    ),
    # --- Slurm heterogeneous job: component 0 pservers, component 1 trainers --------------------
    (
        "het-one-srun-pserver",
        {**HET, "SLURM_NTASKS": "7", "SLURM_PROCID": "1", "SLURMD_NODENAME": "cpu2", "SLURM_LOCALID": "1"},
        RoleEnv(PS, HET_EPS, 4, current_endpoint="cpu2:6171"),
        "slurm",
    ),
    (
        "het-one-srun-trainer",
        {**HET, "SLURM_NTASKS": "7", "SLURM_PROCID": "5", "SLURMD_NODENAME": "gpu1"},
        RoleEnv(TR, HET_EPS, 4, trainer_id=2),
        "slurm",
    ),
    (
        "het-own-srun-pserver",
        {
            **HET,
            "PS_PSERVER_NUM": "3",
            "TRAINING_ROLE": "PSERVER",
            "SLURM_NTASKS": "3",
            "SLURM_PROCID": "2",
            "SLURMD_NODENAME": "cpu1",
            "SLURM_LOCALID": "0",
        },
        RoleEnv(PS, HET_EPS, 4, current_endpoint="cpu1:6170"),
        "slurm",
    ),
    (
        "het-own-srun-trainer",
        {**HET, "TRAINING_ROLE": "TRAINER", "SLURM_NTASKS": "4", "SLURM_PROCID": "3"},
        RoleEnv(TR, HET_EPS, 4, trainer_id=3),
        "slurm",
    ),
    # --- torchrun ---------------------------------------------------------------------------------
    (
        "torchrun-pserver-mode",
        {**TORCHRUN, "PADDLE_PSERVERS_IP_PORT_LIST": EPS},
        RoleEnv(TR, EPS.split(","), 2, trainer_id=1, node=NodeEnv(1, 2, "node0", 29500, 1, 2)),
        "torchrun",
    ),
    (
        "torchrun-trainers-num-agrees",
        {
            **TORCHRUN,
            "PADDLE_PSERVERS_IP_PORT_LIST": EPS,
            "TRAINING_ROLE": "TRAINER",
            "PADDLE_TRAINERS_NUM": "2",
        },
        RoleEnv(TR, EPS.split(","), 2, trainer_id=1, node=NodeEnv(1, 2, "node0", 29500, 1, 2)),
        "torchrun",
    ),
    (
        "other-launcher-rank-div-local",
        {
            **{k: v for k, v in TORCHRUN.items() if not k.startswith("GROUP")},
            "PADDLE_PSERVERS_IP_PORT_LIST": EPS,
        },
        RoleEnv(TR, EPS.split(","), 2, trainer_id=1, node=NodeEnv(1, 2, "node0", 29500, 1, 2)),
        "torchrun",
    ),
    (
        "torchrun-collective",
        {**TORCHRUN, "TRAINING_ROLE": "TRAINER"},
        RoleEnv(TR, [], 2, trainer_id=1, node=NodeEnv(1, 2, "node0", 29500, 3, 4)),
        "torchrun",
    ),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("env, want, source", [c[1:] for c in FOUND], ids=[c[0] for c in FOUND])
def test_engine_environments(env, want, source):
    got = RoleEnv.from_env(env)
    assert got == want
    assert got.source == source
    if got.is_pserver:
        assert got.current_endpoint in got.pservers and got.node == NodeEnv()


def test_sources_in_documented_order():
    assert [name for name, _ in SOURCES] == ["paddle", "kubeflow", "kubernetes", "slurm", "torchrun"]


PRECEDENCE = [
    # ps-launch run inside an engine: the roles it sets explicitly win over what the engine says.
    (
        "launcher-in-slurm",
        {
            **task(0, "gpu12", 0),
            "TF_CONFIG": tf_config("ps", 0),
            **RoleEnv(TR, EPS.split(","), 2, trainer_id=1).to_env(),
        },
        RoleEnv(TR, EPS.split(","), 2, trainer_id=1),
        "paddle",
    ),
    (
        "launcher-pserver-in-pod",
        {
            **SERVICE,
            "HOSTNAME": "ps-pserver-2",
            **RoleEnv(PS, EPS.split(","), 2, current_endpoint="10.0.0.1:6170").to_env(),
        },
        RoleEnv(PS, EPS.split(","), 2, current_endpoint="10.0.0.1:6170"),
        "paddle",
    ),
    (
        "tf-config-before-pod-variables",
        {**SERVICE, "HOSTNAME": "ps-pserver-2", "TF_CONFIG": tf_config("worker", 0)},
        RoleEnv(TR, ctr_eps("ps", 2), 2, trainer_id=0),
        "kubeflow",
    ),
    (
        "pod-before-slurm",
        {**task(0, "gpu12", 0), **SERVICE, "HOSTNAME": "ps-pserver-1"},
        RoleEnv(PS, STS_EPS, 2, current_endpoint="ps-pserver-1.ps-pserver:6170"),
        "kubernetes",
    ),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("env, want, source", [c[1:] for c in PRECEDENCE], ids=[c[0] for c in PRECEDENCE])
def test_precedence(env, want, source):
    got = RoleEnv.from_env(env)
    assert got == want and got.source == source


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "env",
    [
        {},
        {**POD, "HOSTNAME": "web-0"},  # a pod of another app
        {k: v for k, v in task(1, "gpu12", 1).items() if k != "PS_PSERVER_NUM"},  # a Slurm job of another app
        {"JOB_COMPLETION_INDEX": "3", "HOSTNAME": "batch-3"},  # an Indexed Job of another app
        TORCHRUN,  # plain DDP under torchrun
        {**HET, "SLURM_HET_SIZE": "1"},  # SLURM_PROCID unset
    ],
    ids=["empty", "pod", "slurm", "indexed-job", "torchrun", "het-no-procid"],
)
def test_no_role_is_a_local_run(env):
    assert RoleEnv.from_env(env) is None


def test_reads_only_the_mapping_given(monkeypatch):
    for name, value in task(0, "gpu12", 0, TF_CONFIG=tf_config("ps", 0)).items():
        monkeypatch.setenv(name, value)
    assert discover({}) is None
    assert RoleEnv.from_env().source == "kubeflow"


ERRORS = [
    # TF_CONFIG
    ({"TF_CONFIG": "{cluster: }"}, "TF_CONFIG is not JSON"),
    ({"TF_CONFIG": "[]"}, "TF_CONFIG must be a JSON object, got list"),
    ({"TF_CONFIG": json.dumps({"task": {"type": "ps", "index": 0}})}, 'TF_CONFIG has no "cluster" object'),
    (
        {
            "TF_CONFIG": json.dumps(
                {
                    "sparseCluster": {"ps": ["a:1"], "worker": {"0": "b:1"}},
                    "task": {"type": "worker", "index": 0},
                }
            )
        },
        "turn enableDynamicWorker off",
    ),
    ({"TF_CONFIG": tf_config("evaluator", 0)}, "an evaluator has no role in a parameter-server job"),
    ({"TF_CONFIG": tf_config("launcher", 0)}, "TF_CONFIG's task type 'launcher' is none of"),
    ({"TF_CONFIG": tf_config("ps", 2)}, "TF_CONFIG's task index 2 is out of range: the cluster has 2 'ps'"),
    ({"TF_CONFIG": tf_config("worker", "1")}, "TF_CONFIG's task index must be an integer, got '1'"),
    ({"TF_CONFIG": tf_config("ps", 0, workers=0)}, "TF_CONFIG's cluster has no worker or chief"),
    (
        {
            "TF_CONFIG": json.dumps(
                {"cluster": {"ps": "a:1", "worker": ["b:1"]}, "task": {"type": "ps", "index": 0}}
            )
        },
        "TF_CONFIG's cluster['ps'] must be a list",
    ),
    (
        {
            "TF_CONFIG": json.dumps(
                {"cluster": {"ps": ["a"], "worker": ["b:1"]}, "task": {"type": "ps", "index": 0}}
            )
        },
        "TF_CONFIG's cluster['ps']: pserver endpoint 'a' is not of the form host:port",
    ),
    (
        {"TF_CONFIG": tf_config("ps", 0), "TRAINING_ROLE": "TRAINER"},
        "TRAINING_ROLE=TRAINER contradicts TF_CONFIG's task type 'ps', which makes this process a PSERVER",
    ),
    (
        {"TF_CONFIG": tf_config("worker", 0), "PADDLE_TRAINERS_NUM": "3"},
        "PADDLE_TRAINERS_NUM=3 contradicts TF_CONFIG's cluster (chief and workers): 2 trainers",
    ),
    # Kubernetes
    (
        {**SERVICE, "HOSTNAME": "ps-pserver-3"},
        "this pod is pserver 3 (HOSTNAME=ps-pserver-3) but the job has 3",
    ),
    (
        {**SERVICE, "HOSTNAME": "ps-pserver-7d9f8-x2x"},
        "HOSTNAME='ps-pserver-7d9f8-x2x' is not a StatefulSet pod's",
    ),
    (
        {**SERVICE, "PS_PSERVER_STATEFULSET": "ctr-ps", "HOSTNAME": "ps-pserver-1"},
        "HOSTNAME='ps-pserver-1' is not a StatefulSet pod's name ctr-ps-<ordinal>",
    ),
    (
        {**SERVICE, "TRAINING_ROLE": "TRAINER", "JOB_COMPLETION_INDEX": "0"},
        "PS_PSERVER_STATEFULSET is not set",
    ),
    (
        {**SERVICE, "PS_PSERVER_STATEFULSET": "ps-pserver", "TRAINING_ROLE": "TRAINER"},
        "JOB_COMPLETION_INDEX is not set: run trainers as an Indexed Job",
    ),
    (
        {**SERVICE, "PS_PSERVER_STATEFULSET": "ps-pserver", "JOB_COMPLETION_INDEX": "2"},
        "JOB_COMPLETION_INDEX=2 is out of range [0, PS_TRAINER_NUM=2)",
    ),
    (
        {**SERVICE, "JOB_COMPLETION_INDEX": "-1", "PS_PSERVER_STATEFULSET": "ps-pserver"},
        "JOB_COMPLETION_INDEX must be >= 0, got -1",
    ),
    (
        {**{k: v for k, v in SERVICE.items() if k != "PS_TRAINER_NUM"}, "HOSTNAME": "ps-pserver-0"},
        "PS_TRAINER_NUM is not set; a Kubernetes PSERVER needs the number of trainers",
    ),
    (
        {**SERVICE, "PADDLE_TRAINERS_NUM": "3", "HOSTNAME": "ps-pserver-0"},
        "PS_TRAINER_NUM=2 and PADDLE_TRAINERS_NUM=3 disagree",
    ),
    (
        {**{k: v for k, v in SERVICE.items() if k != "PS_PSERVER_NUM"}, "HOSTNAME": "ps-pserver-0"},
        "PS_PSERVER_NUM is not set",
    ),
    ({**SERVICE, "PS_PSERVER_NUM": "0", "HOSTNAME": "ps-pserver-0"}, "PS_PSERVER_NUM must be >= 1, got 0"),
    (
        {**SERVICE, "PS_PSERVER_PORT": "70000", "HOSTNAME": "ps-pserver-0"},
        "PS_PSERVER_PORT must be a port number",
    ),
    (
        {**SERVICE, "PS_PSERVER_SERVICE": "PS_Pserver", "HOSTNAME": "ps-pserver-0"},
        "PS_PSERVER_SERVICE='PS_Pserver' is not a DNS name",
    ),
    (
        {**SERVICE, "HOSTNAME": "ps-pserver-0", "PADDLE_PSERVERS_IP_PORT_LIST": EPS},
        "PADDLE_PSERVERS_IP_PORT_LIST=10.0.0.1:6170,10.0.0.2:6170 contradicts PS_PSERVER_SERVICE",
    ),
    (
        {**SERVICE, "TRAINING_ROLE": "PSERVER", "JOB_COMPLETION_INDEX": "1", "HOSTNAME": "ps-pserver-2"},
        "HOSTNAME=ps-pserver-2 and JOB_COMPLETION_INDEX=1 name different pservers",
    ),
    (
        {
            "TRAINING_ROLE": "PSERVER",
            "PS_PSERVER_STATEFULSET": "ps",
            "HOSTNAME": "ps-0",
            "PS_TRAINER_NUM": "1",
        },
        "a PSERVER pod needs the pserver list",
    ),
    # Slurm
    (
        {**task(0, "gpu12", 0), "SLURM_STEP_TASKS_PER_NODE": "2,1"},
        "SLURM_STEP_NODELIST=gpu[12,03-04] names 3 nodes but SLURM_STEP_TASKS_PER_NODE=2,1 gives tasks for 2",
    ),
    (
        {**task(0, "gpu12", 0), "SLURM_STEP_NUM_TASKS": "6"},
        "SLURM_STEP_NUM_TASKS=6 but SLURM_STEP_TASKS_PER_NODE=2(x2),1 places 5 tasks",
    ),
    (task(0, "gpu12", 0, PS_PSERVER_NUM="5"), "PS_PSERVER_NUM=5 leaves no trainer among the step's 5 tasks"),
    (task(0, "gpu12", 0, PS_PSERVER_NUM="-1"), "PS_PSERVER_NUM must be >= 0, got -1"),
    (task(5, "gpu04", 1), "SLURM_PROCID=5 is out of range [0, SLURM_STEP_NUM_TASKS=5)"),
    (
        task(1, "gpu03", 0),
        "SLURMD_NODENAME=gpu03, but the block layout puts task 1 on gpu12: launch with the "
        "default block distribution (srun -m block)",
    ),
    (task(1, "gpu12", 0), "SLURM_LOCALID=0, but the block layout makes task 1 number 1 on gpu12"),
    (
        task(0, "gpu12", 0, TRAINING_ROLE="TRAINER"),
        "TRAINING_ROLE=TRAINER contradicts SLURM_PROCID=0 < PS_PSERVER_NUM=3, which makes this process a "
        "PSERVER",
    ),
    (
        {**task(0, "gpu12", 0), "SLURM_STEP_NODELIST": "gpu[12,03-04"},
        "SLURM_STEP_NODELIST='gpu[12,03-04' is not a",
    ),
    (
        {**task(0, "gpu12", 0), "SLURM_STEP_NODELIST": "gpu[12,12,04]"},
        "SLURM_STEP_NODELIST='gpu[12,12,04]' names nodes twice: ['gpu12']",
    ),
    (
        {**task(0, "gpu12", 0), "SLURM_STEP_TASKS_PER_NODE": "2(x2,1"},
        "SLURM_STEP_TASKS_PER_NODE='2(x2,1' is not a tasks-per-node list",
    ),
    (
        {k: v for k, v in task(0, "gpu12", 0).items() if not k.endswith("NODELIST")},
        "SLURM_JOB_NODELIST is not set; a Slurm task's role needs it",
    ),
    (task(4, "gpu04", 0, PS_TRAINER_NUM="3"), "PS_TRAINER_NUM=3 contradicts the Slurm step"),
    (
        task(0, "gpu12", 0, PS_PSERVER_PORT="65535"),
        "PS_PSERVER_PORT=65535 + 1 pservers on one node runs past",
    ),
    (
        {**HET, "SLURM_NTASKS": "3", "SLURM_PROCID": "0"},
        "SLURM_NTASKS=3 is not the 3 + 4 tasks of components 0 and 1: with one srun per component, set "
        "TRAINING_ROLE",
    ),
    (
        {**HET, "SLURM_NTASKS": "7", "SLURM_PROCID": "0", "PS_PSERVER_NUM": "2"},
        "PS_PSERVER_NUM=2 contradicts the heterogeneous job's component 0, which runs 3 pserver tasks",
    ),
    (
        {**HET, "SLURM_NTASKS": "3", "SLURM_PROCID": "0", "TRAINING_ROLE": "TRAINER"},
        "SLURM_NTASKS=3: a TRAINER step must run all 4 tasks of component 1",
    ),
    (
        {**HET, "SLURM_NTASKS": "7", "SLURM_PROCID": "0", "TRAINING_ROLE": "TRAINER"},
        "TRAINING_ROLE=TRAINER contradicts SLURM_PROCID=0 in a step over both components",
    ),
    ({**HET, "SLURM_NTASKS": "7", "SLURM_PROCID": "7"}, "SLURM_PROCID=7 is out of range [0, SLURM_NTASKS=7)"),
    (
        {
            **{k: v for k, v in HET.items() if k != "SLURM_TASKS_PER_NODE_HET_GROUP_1"},
            "SLURM_NTASKS": "7",
            "SLURM_PROCID": "0",
        },
        "SLURM_TASKS_PER_NODE_HET_GROUP_1 is not set",
    ),
    # torchrun
    (
        {
            **TORCHRUN,
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "RANK": "1",
            "WORLD_SIZE": "2",
            "PADDLE_PSERVERS_IP_PORT_LIST": EPS,
            "PADDLE_TRAINERS_NUM": "4",
        },
        "PADDLE_TRAINERS_NUM=4 contradicts torchrun's node count (GROUP_WORLD_SIZE): 1 trainers",
    ),
    (
        {**TORCHRUN, "RANK": "2", "PADDLE_PSERVERS_IP_PORT_LIST": EPS},
        "RANK=2 is not GROUP_RANK=1 x LOCAL_WORLD_SIZE=2 + LOCAL_RANK=1",
    ),
    (
        {
            **{k: v for k, v in TORCHRUN.items() if not k.startswith("GROUP")},
            "WORLD_SIZE": "5",
            "RANK": "4",
            "PADDLE_PSERVERS_IP_PORT_LIST": EPS,
        },
        "WORLD_SIZE=5 is not a multiple of LOCAL_WORLD_SIZE=2",
    ),
    (
        {**TORCHRUN, "TRAINING_ROLE": "TRAINER", "WORLD_SIZE": "6"},
        "WORLD_SIZE=6 does not match torchrun's node count=2 x LOCAL_WORLD_SIZE=2 = 4",
    ),
    (
        {**TORCHRUN, "PADDLE_PSERVERS_IP_PORT_LIST": "10.0.0.1"},
        "PADDLE_PSERVERS_IP_PORT_LIST: pserver endpoint '10.0.0.1' is not of the form host:port",
    ),
    # every source
    (
        {**task(0, "gpu12", 0), "TRAINING_ROLE": "WORKER"},
        "TRAINING_ROLE must be one of ('PSERVER', 'TRAINER'), got 'WORKER'",
    ),
    (
        {"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINERS_NUM": "2"},
        "PADDLE_TRAINER_ID is not set; a TRAINER needs it",
    ),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("env, message", ERRORS, ids=[f"{i}-{m[:40]}" for i, (_, m) in enumerate(ERRORS)])
def test_errors_name_the_variable(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RoleEnv.from_env(env)
