"""Freed host memory kept for reuse (trainer/memory.py, ``retain_freed_memory``).

Each case runs in a fresh Python process: the setting is process-wide, and
this test process may already have made a Trainer. What is asserted is what
the setting is for: a buffer freed and allocated again, step after step, costs no page faults.
"""

import platform
import subprocess
import sys
import textwrap

import pytest

from transpiler import DistributeTranspilerConfig

GLIBC = platform.libc_ver()[0] == "glibc"

# A 40 MB tensor written and freed step after step: above glibc's largest automatic mmap threshold
# (32 MiB), so by default each one is a fresh mapping whose every page faults when first written.
# Retained, the freed memory is reused once the heap has settled: torch's 64-byte-aligned requests
# do not always fit the chunk the previous step freed, so the first steps may still grow it.
STEPS = """
import resource, torch
from trainer.memory import retain_freed_memory
if {retain}:
    assert retain_freed_memory() and retain_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for step in range({settle} + {measured}):
    if step == {settle}:
        before = faults()
    t = torch.ones(10 << 20)
    del t
print(faults() - before)
"""
SETTLE, MEASURED = 10, 10


def faults_per_step_once_settled(retain: bool) -> float:
    code = textwrap.dedent(STEPS.format(retain=retain, settle=SETTLE, measured=MEASURED))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return int(out.stdout.split()[-1]) / MEASURED


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_a_buffer_freed_and_allocated_again_faults_its_pages_by_default_and_not_once_retained():
    pages = (40 << 20) // 4096
    assert faults_per_step_once_settled(retain=False) >= pages // 2
    assert faults_per_step_once_settled(retain=True) < pages // 20


def test_the_setting_is_on_by_default_travels_in_the_plan_and_refuses_a_non_bool():
    assert DistributeTranspilerConfig().retain_freed_memory is True
    cfg = DistributeTranspilerConfig(retain_freed_memory=False)
    assert DistributeTranspilerConfig.from_dict(cfg.to_dict()).retain_freed_memory is False
    with pytest.raises(ValueError, match="retain_freed_memory must be a bool"):
        DistributeTranspilerConfig(retain_freed_memory="yes")
