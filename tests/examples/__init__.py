"""Tests of the examples' data readers and the CTR example under ps-launch."""
