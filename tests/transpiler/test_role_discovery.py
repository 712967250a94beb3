"""RoleEnv.from_env in the environments cluster engines really give: Kubeflow's TF_CONFIG, Kubernetes
StatefulSet and Indexed Job pods, Slurm steps (compressed, unsorted node lists; heterogeneous jobs),
torchrun; and the order of precedence among them. The errors that name the variable at fault:
test_role_errors.py."""

from __future__ import annotations

import pytest

from tests.helpers.role_envs import (
    EPS,
    HET,
    HET_EPS,
    POD,
    SERVICE,
    SLURM_EPS,
    STS_EPS,
    TORCHRUN,
    ctr_eps,
    task,
    tf_config,
)
from transpiler import RoleEnv
from transpiler.roles import SOURCES, discover
from transpiler.roles.role_env import NodeEnv

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
    (  # a pod the StatefulSet was scaled up to: the job's list grown to it (it waits for ps-reshard's change)
        "sts-pserver-scaled-up",
        {**POD, **SERVICE, "HOSTNAME": "ps-pserver-3"},
        RoleEnv(
            PS, STS_EPS + ["ps-pserver-3.ps-pserver:6170"], 2, current_endpoint="ps-pserver-3.ps-pserver:6170"
        ),
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
