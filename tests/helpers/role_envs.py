"""The environments cluster engines give a pod, task or process, for the role discovery tests
(tests/transpiler/test_role_discovery.py, test_role_errors.py): Kubeflow's TF_CONFIG, a Kubernetes
StatefulSet's pod, a Slurm step and a heterogeneous job, torchrun."""

from __future__ import annotations

import json

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
