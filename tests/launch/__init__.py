"""Tests of ps-launch: its pure pieces and real supervised jobs."""
