"""A real two-node Slurm cluster on this machine, for tests: munged, slurmctld and two slurmd.

Everything runs in one private network namespace (``ip netns``), so the daemons' ports (Slurm
binds 0.0.0.0) and the jobs' pservers are invisible outside it and cannot collide with anything
on the machine. The two nodes are two ``slurmd -N <node>`` on 127.0.0.1 and 127.0.0.2 with
their own ports and spool directories; inside the namespace ``n1`` and ``n2`` resolve to those
addresses through a hosts file bind-mounted over /etc/hosts (in the mount namespace that
``ip netns exec`` makes, which every job task inherits from its slurmd).

Two details make Slurm start in such a namespace: Slurm resolves names with AI_ADDRCONFIG,
which finds no IPv4 address on loopback alone, so the namespace also gets a veth pair with an
address; and ``ip netns exec`` remounts /sys without the cgroup mounts, so cgroup.conf names
``cgroup/v1`` instead of autodetecting (no cgroup is used: proctrack/linuxproc, task/none).

Needs root (slurmd runs as SlurmdUser=root; namespaces need CAP_SYS_ADMIN) and Debian's
``slurm-wlm`` (22.05) with ``munge``; :func:`start_cluster` raises :class:`ClusterUnavailable`,
naming the failing command and its output, where they are missing or do not start (the test's
fixture turns that into a skip, or a failure under ``PS_REQUIRE_SYSTEM_TESTS``:
:mod:`tests.helpers.system`).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from harness.netns import clear_namespace
from tests.helpers.system import missing_prerequisites

NODES = {"n1": "127.0.0.1", "n2": "127.0.0.2"}
CTLD_PORT, FIRST_SLURMD_PORT = 6817, 6818  # free in a fresh namespace
CPUS_PER_NODE = 4  # oversubscribed: config_overrides
BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "srun", "ip")
AUTH_NONE_PLUGIN = "auth_none.so"
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}
# Proxy variables would send gRPC's connections to n1/n2 through a proxy.
DROPPED_VARS = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "no_proxy")


class ClusterUnavailable(RuntimeError):
    """Slurm is not installed here or did not start; the message names the command and its output."""


def slurm_conf(root: Path, auth: str, munge_socket: Optional[Path]) -> str:
    """The cluster's slurm.conf: two nodes on loopback addresses, state and logs under ``root``.

    ``auth`` is ``"munge"`` (with ``munge_socket``) or ``"none"``. cred_expire=5: Slurm holds a
    requeued job for the credential lifetime (default 120 s) before it may start again.
    """
    auth_info = f"socket={munge_socket},cred_expire=5" if auth == "munge" else "cred_expire=5"
    lines = [
        "ClusterName=pstest",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={CTLD_PORT}",
        f"AuthType=auth/{auth}",
        f"CredType=cred/{auth}",
        f"AuthInfo={auth_info}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        # Heterogeneous jobs are scheduled by backfill only: every second instead of every 30 s; and
        # a requeued job, eligible again after cred_expire, waits for the main scheduler's next pass
        # (every 60 s by default; sooner only on events).
        "SchedulerType=sched/backfill",
        "SchedulerParameters=bf_interval=1,sched_interval=1",
        "SlurmdParameters=config_overrides",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "JobRequeue=0",  # only the batch scripts' own --requeue makes a job requeueable
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "KillWait=5",
    ]
    for i, (node, addr) in enumerate(NODES.items()):
        lines.append(
            f"NodeName={node} NodeHostname=localhost NodeAddr={addr} Port={FIRST_SLURMD_PORT + i} "
            f"CPUs={CPUS_PER_NODE} RealMemory=1000 State=UNKNOWN"
        )
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES")
    return "\n".join(lines) + "\n"


def hosts_file() -> str:
    """/etc/hosts inside the namespace: localhost and each node's address."""
    lines = ["127.0.0.1 localhost"] + [f"{addr} {node}" for node, addr in NODES.items()]
    return "\n".join(lines) + "\n"


def parse_jobs(text: str) -> List[Dict[str, str]]:
    """``scontrol show job -o`` output: one ``{field: value}`` per line (one per het job component)."""
    jobs = []
    for line in text.splitlines():
        if line.strip():
            jobs.append(dict(m.groups() for m in re.finditer(r"(\S+?)=(\S*)", line)))
    return jobs


def finished(components: Sequence[Mapping[str, str]]) -> bool:
    """True once every component of a job is in a terminal state."""
    return bool(components) and all(c.get("JobState") in TERMINAL_STATES for c in components)


def run(cmd: Sequence[str], timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` (no shell), capturing its output as text; a failure to start reads as exit -1."""
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kwargs)
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(list(cmd), -1, "", str(e))


def describe(r: subprocess.CompletedProcess) -> str:
    return f"`{' '.join(map(str, r.args))}` exited {r.returncode}: {(r.stderr or r.stdout).strip()[-1500:]}"


@dataclass
class SlurmCluster:
    """The running cluster. :meth:`cmd` wraps a command to run inside it (namespace and hosts file)."""

    root: Path
    ns: str
    auth: str = "munge"
    daemons: Dict[str, subprocess.Popen] = field(default_factory=dict)
    created_ns: bool = False

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    def env(self, extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """This environment for Slurm's commands: SLURM_CONF set, no outer SLURM_* or proxy variables."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k.lower() not in DROPPED_VARS
        }
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def cmd(self, *argv: str) -> List[str]:
        hosts = self.root / "etc" / "hosts"
        return [
            "ip",
            "netns",
            "exec",
            self.ns,
            "sh",
            "-c",
            'mount --bind "$0" /etc/hosts && exec "$@"',
            str(hosts),
            *argv,
        ]

    def run(
        self,
        *argv: str,
        env: Optional[Mapping[str, str]] = None,
        timeout: float = 30,
        cwd: Optional[Path] = None,
    ) -> subprocess.CompletedProcess:
        return run(self.cmd(*argv), timeout=timeout, env=self.env(env), cwd=cwd)

    def start_daemon(self, name: str, *argv: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        with log:
            self.daemons[name] = subprocess.Popen(
                self.cmd(*argv),
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def daemon_logs(self, lines: int = 15) -> str:
        """The tail of every daemon's output and log file, for an error message."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()
            text = [t for t in text if "pmix" not in t.lower()]  # PMIx is not installed: noise
            parts.append(f"--- {path.name}\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)

    def node_state(self, node: str) -> str:
        """The node's state as sinfo prints it (``idle``, ``allocated``, ``down*``, ...)."""
        r = self.run("sinfo", "-h", "-N", "-n", node, "-o", "%T")
        if r.returncode != 0:
            raise AssertionError(f"sinfo failed: {describe(r)}")
        return r.stdout.strip()

    def submit(self, *argv: str, env: Optional[Mapping[str, str]] = None, cwd: Optional[Path] = None) -> int:
        """``sbatch --parsable ARGV``: the job id."""
        r = self.run("sbatch", "--parsable", *argv, env=env, cwd=cwd)
        if r.returncode != 0:
            raise AssertionError(f"sbatch failed: {describe(r)}")
        return int(r.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> List[Dict[str, str]]:
        """Every component of the job as ``scontrol show job -o`` shows it."""
        r = self.run("scontrol", "show", "job", "-o", str(job_id))
        if r.returncode != 0:
            raise AssertionError(f"scontrol failed: {describe(r)}")
        return parse_jobs(r.stdout)

    def wait_job(self, job_id: int, timeout: float) -> List[Dict[str, str]]:
        """Poll until every component of the job has finished; its components. Fails after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            components = self.job(job_id)
            if finished(components):
                return components
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} did not finish within {timeout} s: "
                    f"{[c.get('JobState') for c in components]}\n{self.daemon_logs()}"
                )
            time.sleep(0.25)

    def wait_until(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.daemon_logs()}")
            time.sleep(0.1)

    def close(self) -> None:
        """Cancel every job, stop the daemons, kill whatever still runs in the namespace, delete it."""
        if self.daemons.get("slurmctld") and self.daemons["slurmctld"].poll() is None:
            r = self.run("squeue", "-h", "-o", "%i", timeout=10)
            for job_id in r.stdout.split() if r.returncode == 0 else []:
                self.run("scancel", job_id, timeout=10)
        # Last started, first stopped: the Slurm daemons still talk (through munged) as they stop.
        for proc in reversed(list(self.daemons.values())):
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass  # clear_namespace below still kills it; the namespace must go regardless
        if self.created_ns:
            # slurmstepd and job tasks leave their daemon's session: every process still in this
            # namespace is one the cluster started.
            clear_namespace(self.ns)
            self.created_ns = False


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group is the daemon's own
    except ProcessLookupError:
        pass


def choose_auth() -> str:
    """``munge`` where munged is installed, else ``none`` where this Slurm build has the auth/none plugin."""
    if shutil.which("munged") and shutil.which("munge"):
        return "munge"
    for libdir in (
        "/usr/lib/x86_64-linux-gnu/slurm-wlm",
        "/usr/lib/aarch64-linux-gnu/slurm-wlm",
        "/usr/lib64/slurm",
        "/usr/lib/slurm",
    ):
        if (Path(libdir) / AUTH_NONE_PLUGIN).exists():
            return "none"
    raise ClusterUnavailable(
        "neither munged nor Slurm's auth/none plugin is installed (apt-get install slurm-wlm munge)"
    )


def start_cluster(root: Path, timeout: float = 30) -> SlurmCluster:
    """Start munged, slurmctld and a slurmd per node under ``root``; return once sinfo shows both idle.

    Raises ClusterUnavailable (the caller skips or fails: :func:`tests.helpers.system.unavailable`)
    where Slurm is missing or does not start; the cluster is closed again before it raises.
    """
    reason = missing_prerequisites(BINARIES, "apt-get install slurm-wlm munge iproute2")
    if reason:
        raise ClusterUnavailable(reason)
    if os.geteuid() != 0:
        raise ClusterUnavailable(
            f"not root (euid {os.geteuid()}): slurmd runs as root (SlurmdUser=root) and "
            "network namespaces need root"
        )
    auth = choose_auth()
    cluster = SlurmCluster(root, f"ps-slurm-{os.getpid()}", auth)
    try:
        _setup(cluster)
        _wait_idle(cluster, timeout)
    except BaseException:
        cluster.close()
        raise
    return cluster


def _check(r: subprocess.CompletedProcess) -> None:
    if r.returncode != 0:
        raise ClusterUnavailable(describe(r))


def _setup(cluster: SlurmCluster) -> None:
    root, ns = cluster.root, cluster.ns
    for d in ("etc", "state", "log", "munge", *(f"spool/{n}" for n in NODES)):
        (root / d).mkdir(parents=True, exist_ok=True)
    _check(run(["ip", "netns", "add", ns]))
    cluster.created_ns = True
    # A veth pair with an address: without a non-loopback IPv4 address getaddrinfo(AI_ADDRCONFIG)
    # answers nothing, and Slurm cannot resolve even localhost.
    for cmd in (
        ["link", "set", "lo", "up"],
        ["link", "add", "psva", "type", "veth", "peer", "name", "psvb"],
        ["addr", "add", "10.232.0.1/24", "dev", "psva"],
        ["link", "set", "psva", "up"],
        ["link", "set", "psvb", "up"],
    ):
        _check(run(["ip", "-n", ns, *cmd]))
    (root / "etc" / "hosts").write_text(hosts_file())
    munge_socket = root / "munge" / "munge.socket"
    cluster.conf.write_text(slurm_conf(root, cluster.auth, munge_socket))
    # Autodetection looks at /sys/fs/cgroup, which `ip netns exec` hides; nothing uses cgroups here.
    (root / "etc" / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nIgnoreSystemd=yes\n")
    _check(cluster.run("true"))  # the namespace and the hosts bind mount work
    if cluster.auth == "munge":
        key = root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        os.chmod(root / "munge", 0o700)
        cluster.start_daemon(
            "munged",
            "munged",
            "-F",
            "-f",
            f"--socket={munge_socket}",
            f"--key-file={key}",
            f"--pid-file={root}/munge/munged.pid",
            f"--seed-file={root}/munge/munged.seed",
            f"--log-file={root}/log/munged.log",
        )
        _wait_for(cluster, lambda: munge_socket.exists(), 10, "munged's socket")
        probe = run(["sh", "-c", f"munge -n -S {munge_socket} | unmunge -S {munge_socket}"], timeout=10)
        _check(probe)
    cluster.start_daemon("slurmctld", "slurmctld", "-D")
    for node in NODES:
        cluster.start_daemon(f"slurmd-{node}", "slurmd", "-D", "-N", node)


def _wait_for(cluster: SlurmCluster, predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        dead = [name for name, p in cluster.daemons.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            reason = f"{', '.join(dead)} exited" if dead else f"no {what} within {timeout} s"
            raise ClusterUnavailable(f"{reason}\n{cluster.daemon_logs()}")
        time.sleep(0.1)


def _wait_idle(cluster: SlurmCluster, timeout: float) -> None:
    last: List[subprocess.CompletedProcess] = []

    def idle() -> bool:
        r = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", timeout=10)
        last[:] = [r]
        states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
        return r.returncode == 0 and all(states.get(node) == "idle" for node in NODES)

    try:
        _wait_for(cluster, idle, timeout, "idle nodes")
    except ClusterUnavailable as e:
        raise ClusterUnavailable(
            f"{describe(last[0]) if last else 'sinfo never ran'}: {last[0].stdout if last else ''}\n{e}"
        ) from None
