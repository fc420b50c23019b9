#!/usr/bin/env python3
"""How ftrun talks to etcd, measured: ftrun's own client (``ftrun.etcd``, etcd's JSON gateway on the
standard library) against the maintained Python libraries, on a 3-member cluster on this machine.

    python -m venv /tmp/clients && /tmp/clients/bin/pip install etcd3gw aetcd
    PYTHONPATH=. /tmp/clients/bin/python scripts/bench_etcd_clients.py

A library that is not installed is left out. Each call is timed N times in a row (the median and the
95th percentile, in ms): a put, a read, the leader-conditioned write (a transaction comparing one key),
and how long a waiting watch takes to see a put. Also the import time, in a fresh interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import emit_json  # noqa: E402
from etcd_cluster import EtcdCluster  # noqa: E402


def timed(fn: Callable[[int], object], n: int) -> tuple[float, float]:
    times = []
    for i in range(n):
        start = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return statistics.median(times), times[int(0.95 * (n - 1))]


def watch_wake(wait: Callable[[], None], write: Callable[[], None], n: int) -> float:
    """The median time from a put to the return of a watch that was waiting for it."""
    delays = []
    for _ in range(n):
        put_at: list[float] = []

        def later():
            time.sleep(0.05)
            put_at.append(time.perf_counter())
            write()

        writer = threading.Thread(target=later)
        writer.start()
        wait()
        delays.append((time.perf_counter() - put_at[0]) * 1000)
        writer.join()
    return statistics.median(delays)


def import_time(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return float(out.stdout) * 1000 if out.returncode == 0 else float("nan")


def bench_ftrun(endpoints: str, n: int) -> dict:
    from ftrun.contract import parse_endpoint
    from ftrun.etcd import EtcdClient, EtcdOptions, put, value_is

    client = EtcdClient(EtcdOptions(tuple(parse_endpoint(e, 2379) for e in endpoints.split(","))))
    client.put("bench/leader", "me")
    client.put("bench/w", "x")
    row = {"put": timed(lambda i: client.put("bench/k", str(i)), n),
           "read": timed(lambda i: client.get("bench/k"), n),
           "conditioned write": timed(lambda i: client.txn([value_is("bench/leader", "me")], [put("bench/k", str(i))]), n)}

    def wait():
        client.wait_change("bench/w", client.get("bench/w").mod_revision, 5)

    other = EtcdClient(client.options)
    row["watch wake"] = watch_wake(wait, lambda: other.put("bench/w", "x"), max(5, n // 10))
    row["import"] = import_time("ftrun.etcd")
    return row


def bench_etcd3gw(endpoints: str, n: int) -> dict:
    import etcd3gw

    host, port = endpoints.split(",")[0].split(":")
    client = etcd3gw.client(host=host, port=int(port))
    client.put("bench/leader", "me")
    txn = {"compare": [{"key": etcd3gw.utils._encode("bench/leader"), "result": "EQUAL", "target": "VALUE",
                        "value": etcd3gw.utils._encode("me")}],
           "success": [{"request_put": {"key": etcd3gw.utils._encode("bench/k"), "value": etcd3gw.utils._encode("v")}}]}
    row = {"put": timed(lambda i: client.put("bench/k", str(i)), n),
           "read": timed(lambda i: client.get("bench/k"), n),
           "conditioned write": timed(lambda i: client.transaction(txn), n)}

    def wait():
        events, cancel = client.watch("bench/w")
        next(iter(events))
        cancel()

    other = etcd3gw.client(host=host, port=int(port))
    row["watch wake"] = watch_wake(wait, lambda: other.put("bench/w", "x"), max(5, n // 10))
    row["import"] = import_time("etcd3gw")
    return row


def bench_aetcd(endpoints: str, n: int) -> dict:
    import aetcd

    host, port = endpoints.split(",")[0].split(":")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):  # the threads of ftrun's agent and controller would call it so
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    client = aetcd.Client(host=host, port=int(port))
    run(client.connect())
    run(client.put(b"bench/leader", b"me"))

    async def conditioned(i):
        return await client.transaction(compare=[client.transactions.value(b"bench/leader") == b"me"],
                                         success=[client.transactions.put(b"bench/k", str(i).encode())], failure=[])

    row = {"put": timed(lambda i: run(client.put(b"bench/k", str(i).encode())), n),
           "read": timed(lambda i: run(client.get(b"bench/k")), n),
           "conditioned write": timed(lambda i: run(conditioned(i)), n)}
    row["watch wake"] = watch_wake(lambda: run(client.watch_once(b"bench/w", timeout=5)),
                                   lambda: run(client.put(b"bench/w", b"x")), max(5, n // 10))
    row["import"] = import_time("aetcd")
    run(client.close())
    return row


CLIENTS = {"ftrun.etcd (JSON gateway, stdlib)": bench_ftrun, "etcd3gw (JSON gateway, requests)": bench_etcd3gw,
           "aetcd (gRPC, asyncio)": bench_aetcd}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=300, help="calls of each kind (default 300)")
    parser.add_argument("--json", default="", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        cluster = EtcdCluster.start(Path(folder), 3)
        try:
            for name, bench in CLIENTS.items():
                try:
                    results[name] = bench(cluster.endpoints, args.n)
                except ImportError:
                    print(f"({name}: not installed, left out)")
        finally:
            cluster.stop()
    print(f"{'client':36} {'put':>13} {'read':>13} {'cond. write':>13} {'watch wake':>10} {'import':>8}")
    print(f"{'':36} {'median/p95 ms':>13} {'median/p95 ms':>13} {'median/p95 ms':>13} {'ms':>10} {'ms':>8}")
    for name, row in results.items():
        cells = [f"{row[k][0]:.2f}/{row[k][1]:.2f}" for k in ("put", "read", "conditioned write")]
        print(f"{name:36} {cells[0]:>13} {cells[1]:>13} {cells[2]:>13} {row['watch wake']:>10.1f} {row['import']:>8.0f}")
    if args.json:
        emit_json(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
