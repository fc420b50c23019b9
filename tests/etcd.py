"""A real etcd cluster for the high-availability tests: ``scripts/etcd_cluster.py``'s, which the
benchmarks and a first try by hand use too. Each test that needs one starts its own (three members on
loopback ports, about a second), so that killing members never reaches another test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.parts import unavailable

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "etcd_cluster.py"
_spec = importlib.util.spec_from_file_location("etcd_cluster", _PATH)
etcd_cluster = importlib.util.module_from_spec(_spec)
sys.modules["etcd_cluster"] = etcd_cluster
_spec.loader.exec_module(etcd_cluster)
EtcdCluster = etcd_cluster.EtcdCluster


def start_cluster(folder: Path, size: int = 3) -> EtcdCluster:
    """A cluster, or the test skips saying why (etcd not installed: scripts/test.sh installs it as root); on
    CI, which installs it, a cluster that does not start fails the test."""
    try:
        return EtcdCluster.start(folder, size)
    except etcd_cluster.EtcdUnavailable as e:
        unavailable(str(e))
