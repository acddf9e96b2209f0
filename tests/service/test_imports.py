"""Importing the server and client modules does nothing (no stub generation, no environment
reads), and the client CLI loads none of the server's numerical stack. Which module may import
which is tests/unit/test_layers.py's table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.grpc_harness import ROOT

# Run in a fresh interpreter: os.environ records every key looked up, stub generation raises.
IMPORT_PROBE = r"""
import json, os, sys
from collections.abc import MutableMapping

reads = []


class Recording(MutableMapping):
    def __init__(self, env):
        self._env = env

    def __getitem__(self, key):
        reads.append(key)
        return self._env[key]

    def __setitem__(self, key, value):
        self._env[key] = value

    def __delitem__(self, key):
        del self._env[key]

    def __iter__(self):
        return iter(self._env)

    def __len__(self):
        return len(self._env)

    def copy(self):
        return dict(self._env)

    def items(self):                 # a bulk copy (wsgiref takes one) reads no one setting
        return self._env.items()


os.environ = Recording(os.environ)
from service import proto_build


def refuse(*args, **kw):
    raise AssertionError("stubs generated or imported on import")


proto_build.ensure_stubs = proto_build.generate = proto_build.stubs = refuse
import clients, clients.cli, clients.client, service.cli, service.serve, service.server

print(json.dumps({"env": [k for k in reads if k.startswith("SPECSTREAM")],
                  "proto": sorted(m for m in sys.modules
                                  if m == "service.proto" or m.startswith("service.proto."))}))
"""


def test_importing_server_and_client_does_nothing():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECSTREAM_TARGET": "127.0.0.1:1"}
    r = subprocess.run([sys.executable, "-c", IMPORT_PROBE], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.splitlines()[-1])
    assert seen == {"env": [], "proto": []}



def test_client_cli_loads_neither_numpy_nor_gguf():
    """specstream-client runs where only the client is wanted: importing its CLI and building
    its parser (the flags come from the protos) loads no numpy, gguf or model code."""
    code = ("import sys, clients.cli; clients.cli.build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'gguf', 'numba'}), "
            "sorted(m for m in sys.modules if m.startswith('service.') "
            "and not m.startswith(('service.proto', 'service.proto_build'))))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[] []"
