"""What the GPU machine lacks, fetched here as wheels into ``.whl/`` to travel with the tree.

The GPU machine has its own Python 3.12 with a CUDA build of torch, numpy, numba, pytest and
pytest-xdist, scikit-learn, tensorboard, prometheus-client, grpcio and protobuf (versions unknown),
and no network. Everything else the project imports at run time (``pyproject.toml``: the
dependencies and the test extra), and every package those need, comes from here: the versions
installed in this environment (the combination the suite passes with), as cp312 manylinux
x86_64 wheels. grpcio and protobuf travel too, pinned: the generated wire code checks the
runtime it runs on (``proto/ps_pb2.py`` names the protobuf it was made with), and the machine's
may be older. ``benchmarks/gpu_check.sh`` installs them there into a folder of their own, first on
PYTHONPATH, without touching the machine's packages.

The peers' ``jobs.py`` (jobs D and S; ``../shared/peers``, beside the repository, not in it)
travels in ``.whl/peers/``.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from typing import Dict, Iterable, List, Set

from benchmarks.common.paths import DEFAULT_PEERS, REPO

log = logging.getLogger("gpu_check.wheels")

WHEEL_DIR = os.path.join(REPO, ".whl")
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")
# What the GPU machine has (its own builds, matched to its CUDA torch), or what the check never imports.
NOT_CARRIED = {
    "torch": "the machine's CUDA build",
    "numpy": "the machine's (its numba and torch are built for it)",
    "numba": "the machine's",
    "llvmlite": "numba's, the machine's",
    "pytest": "the machine's",
    "pytest-xdist": "the machine's",
    "execnet": "pytest-xdist's",
    "pluggy": "pytest's",
    "iniconfig": "pytest's",
    "packaging": "pytest's",
    "scikit-learn": "the machine's (13 MB)",
    "grpcio-tools": "regenerates the wire code; the check does not",
    "cryptography": "the TLS tests' only",
    "kubernetes-validate": "the deploy tests' only",
    "tomli": "Python 3.10 only",
}
MAX_BYTES = 40 * 2**20  # the tree travels in 64 MiB at most


def canonical(name: str) -> str:
    """A distribution name as pip compares them: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(pyproject_text: str) -> List[str]:
    """The names of the project's dependencies and of its test extra, in pyproject.toml's order."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads(pyproject_text)["project"]
    specs = list(project["dependencies"]) + list(project.get("optional-dependencies", {}).get("test", []))
    names = []
    for spec in specs:
        name = canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec.strip()).group(0))
        if name not in names:
            names.append(name)
    return names


def _requires(name: str) -> List[str]:
    """The distributions ``name`` (installed here) needs on Linux under Python 3.12, extras aside."""
    from packaging.requirements import Requirement

    env = {
        "python_version": PYTHON_VERSION,
        "python_full_version": PYTHON_VERSION + ".0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }
    out = []
    for text in importlib.metadata.distribution(name).requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(env):
            out.append(canonical(req.name))
    return out


def closure(names: Iterable[str], skip: Iterable[str]) -> Dict[str, str]:
    """{distribution: version installed here} of ``names`` and all they need, less ``skip`` and what they
    need.

    Raises LookupError naming a distribution that is not installed here (its version is unknown).
    """
    skip = {canonical(s) for s in skip}
    found: Dict[str, str] = {}
    todo = [canonical(n) for n in names]
    seen: Set[str] = set()
    while todo:
        name = todo.pop(0)
        if name in seen or name in skip:
            continue
        seen.add(name)
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise LookupError(
                f"{name} is not installed here, so its version is unknown: pip install -e '.[test]' first"
            ) from None
        todo += _requires(name)
    return found


def download_command(pins: Dict[str, str], dest: str) -> List[str]:
    """``pip download`` of exactly these versions as cp312 manylinux x86_64 wheels, no dependency
    resolution."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
        dest,
    ]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + [f"{name}=={version}" for name, version in sorted(pins.items())]


def fetch(dest: str = WHEEL_DIR, peers: str = DEFAULT_PEERS) -> Dict[str, object]:
    """Fill ``dest`` with the wheels and the peers' jobs.py; returns the manifest it writes there."""
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        names = requirement_names(f.read())
    pins = closure([n for n in names if n not in NOT_CARRIED], NOT_CARRIED)
    os.makedirs(dest, exist_ok=True)
    for old in glob.glob(os.path.join(dest, "*.whl")):
        os.remove(old)
    log.info(
        "downloading %d wheels for Python %s: %s",
        len(pins),
        PYTHON_VERSION,
        ", ".join(f"{k}=={v}" for k, v in sorted(pins.items())),
    )
    subprocess.run(download_command(pins, dest), check=True)
    jobs = os.path.join(peers, "jobs.py")
    if os.path.isfile(jobs):
        os.makedirs(os.path.join(dest, "peers"), exist_ok=True)
        shutil.copy2(jobs, os.path.join(dest, "peers", "jobs.py"))
    else:
        log.warning(
            "no %s: stages d and e will fail on the GPU machine unless ../shared/peers is there", jobs
        )
    wheels = sorted(glob.glob(os.path.join(dest, "*.whl")))
    total = sum(os.path.getsize(w) for w in wheels)
    manifest = {
        "python": PYTHON_VERSION,
        "platforms": list(PLATFORMS),
        "pins": pins,
        "wheels": [os.path.basename(w) for w in wheels],
        "bytes": total,
        "peers_jobs": os.path.isfile(os.path.join(dest, "peers", "jobs.py")),
        "not_carried": NOT_CARRIED,
    }
    with open(os.path.join(dest, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    with open(os.path.join(dest, "PYTHON"), "w") as f:  # gpu_check.sh installs only into this Python
        f.write(PYTHON_VERSION + "\n")
    if total > MAX_BYTES:
        raise RuntimeError(
            f"the wheels take {total / 2**20:.1f} MiB, over the {MAX_BYTES / 2**20:.0f} MiB "
            f"the tree can spare: leave something the GPU machine has out"
        )
    return manifest
