"""Tests of psproto: the generated modules, the codec, shared memory, security."""
