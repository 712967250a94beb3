"""Tests of hot standby: decisions, coordination against etcd, chaos, ps-launch."""
