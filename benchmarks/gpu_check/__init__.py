"""The GPU check: the CUDA path run end to end in the first minutes a GPU is available.

``python -m benchmarks.gpu_check`` (or ``bash benchmarks/gpu_check.sh`` on the GPU machine) runs
the stages of :mod:`benchmarks.gpu_check.stages`, each a worker ``*_stage.py`` in its own process
with its own deadline, and prints one table (:mod:`benchmarks.gpu_check.report`). Without a GPU it
makes a dry run. :mod:`benchmarks.gpu_check.wheels` fetches what the GPU machine lacks.
"""
