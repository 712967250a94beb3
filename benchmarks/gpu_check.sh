#!/usr/bin/env bash
# The GPU check (python -m benchmarks.gpu_check; benchmarks/README.md says what it runs), from a bare
# copy of the tree: on the GPU machine nothing of the project is installed and there is no network.
#
# The wheels `python -m benchmarks.gpu_check --fetch-wheels` left in .whl/ (carried with the tree) go
# into a folder of their own (PS_SITE, default /tmp/ps-site), without their dependencies and without
# touching the machine's packages, when this Python is the one they were fetched for; that folder and
# the repository go first on PYTHONPATH, and the folder maps the import name `psproto` to proto/ (what
# installing the project would do). Arguments go to the check: --dry-run, --stages a,b, --device cpu.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$(pwd)"
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
else  # the Python with the machine's (CUDA) torch
    PY=""
    for candidate in python3 python; do
        if command -v "$candidate" > /dev/null && "$candidate" -c "import torch" 2> /dev/null; then
            PY="$(command -v "$candidate")"
            break
        fi
    done
    if [ -z "$PY" ]; then
        echo "gpu_check.sh: neither python3 nor python here imports torch; set PYTHON" >&2
        exit 2
    fi
fi
SITE="${PS_SITE:-/tmp/ps-site}"

if compgen -G ".whl/*.whl" > /dev/null && [ -f .whl/PYTHON ] \
        && [ "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$(cat .whl/PYTHON)" ]; then
    echo "gpu_check.sh: installing $(ls .whl/*.whl | wc -l) carried wheels into $SITE"
    rm -rf "$SITE"
    mkdir -p "$SITE"
    if "$PY" -m pip --version > /dev/null 2>&1; then
        "$PY" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target "$SITE" .whl/*.whl
    else  # no pip: a wheel is a zip of what goes on sys.path
        for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" "$SITE"; done
    fi
fi
mkdir -p "$SITE"
ln -sfn "$REPO/proto" "$SITE/psproto"
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m benchmarks.gpu_check "$@"
