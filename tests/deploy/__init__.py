"""Tests of deploy/: Kubernetes manifests and Slurm scripts, checked offline."""
