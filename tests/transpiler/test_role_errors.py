"""RoleEnv.from_env refuses the environments it cannot read, with an error that names the variable at fault
(TF_CONFIG, the pod's variables, Slurm's lists, torchrun's sizes, the launcher's own); the environments it
reads: test_role_discovery.py."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.role_envs import (
    EPS,
    HET,
    SERVICE,
    TORCHRUN,
    task,
    tf_config,
)
from transpiler import RoleEnv

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
    (  # with hot standby a StatefulSet scaled past its pods is a mistake (without, a pod that joins)
        {**SERVICE, "PS_SERVER_REPLICAS": "2", "HOSTNAME": "ps-pserver-6"},
        "this pod is pserver 6 (HOSTNAME=ps-pserver-6) but the job has 6",
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
