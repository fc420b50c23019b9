"""``--metrics-port``: the controller's Prometheus endpoint, through the ``prometheus_client`` library.

Everything comes from what the controller holds already: the status snapshot (steps, rates, each rank's step
and wait times, the straggler scores, the budget) and the event log (faults, repairs and their phases). It is
updated as the board is rebuilt (``update``), in the controller's thread; the library's HTTP server, in a
thread of its own (``ftrun-metrics``), serves the registry's latest values. A registry of the job's own,
not the process's global one: an agent's controller and a test's in one process never mix.
"""

from __future__ import annotations

import http.server
import logging
import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import MetricsHandler

log = logging.getLogger(__name__)
#: repair times (seconds) the histograms count in: a process-level repair takes seconds, a job-level restart more
REPAIR_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class JobMetrics:
    """The job's metrics, read from the status snapshot and the event log."""

    def __init__(self, run_id: str, clock: Callable[[], float] = time.monotonic):
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.clock = clock
        self.steps_per_second = Gauge("ftrun_steps_per_second", "Training rate: committed steps per second (lowest rank)",
                                      registry=registry)
        self.step = Gauge("ftrun_step", "The lowest committed step across ranks", registry=registry)
        self.generation = Gauge("ftrun_generation", "The generation the job runs (one more at each repair)", registry=registry)
        self.restarts_left = Gauge("ftrun_restarts_left", "Repairs the job-wide budget (--max-restarts) allows still",
                                   registry=registry)
        self.rank_step = Gauge("ftrun_rank_step_seconds", "A rank's median step time over its last steps",
                               ["rank", "node"], registry=registry)
        self.rank_compute = Gauge("ftrun_rank_compute_seconds", "A rank's median compute time per step (outside collectives)",
                                  ["rank", "node"], registry=registry)
        self.rank_wait = Gauge("ftrun_rank_wait_seconds", "A rank's median wait per step inside collectives",
                               ["rank", "node"], registry=registry)
        self.straggler_score = Gauge("ftrun_straggler_score", "A rank's compute time over the job's median",
                                     ["rank", "node"], registry=registry)
        self.outside_score = Gauge("ftrun_outside_straggler_score", "A rank's CPU time over the job's median, seen from "
                                   "outside (a script without the worker library)", ["rank", "node"], registry=registry)
        self.rank_cpu = Gauge("ftrun_rank_cpu_seconds_per_second", "A rank's CPU seconds per wall second (its process "
                              "group, read from /proc by its agent)", ["rank", "node"], registry=registry)
        self.node_straggler_score = Gauge("ftrun_node_straggler_score", "A node's worst rank's straggler score",
                                          ["node"], registry=registry)
        self.stragglers = Gauge("ftrun_stragglers", "Ranks named stragglers now", registry=registry)
        self.faults = Counter("ftrun_faults", "Faults seen, by kind (exit, signal, hang, device, collective, node_lost, "
                              "straggler, ...) and device fault level", ["kind", "level"], registry=registry)
        self.repairs = Counter("ftrun_repairs", "Repairs done, by level", ["level"], registry=registry)
        self.repair_seconds = Histogram("ftrun_repair_seconds", "A repair's time from the fault to training again",
                                        ["level"], buckets=REPAIR_BUCKETS, registry=registry)
        self.repair_phase_seconds = Histogram("ftrun_repair_phase_seconds", "Each phase of a repair",
                                              ["level", "phase"], buckets=REPAIR_BUCKETS, registry=registry)
        self.training = Counter("ftrun_training_seconds", "Time the job trained (running)", registry=registry)
        self.lost = Counter("ftrun_lost_seconds", "Time the job lost to faults (stopping, repairing, restarting)",
                            registry=registry)
        self.goodput = Gauge("ftrun_goodput_ratio", "Time training over time training and lost to faults", registry=registry)
        info = Gauge("ftrun_job_info", "The job's run id", ["run_id"], registry=registry)
        info.labels(run_id=run_id).set(1)
        self._events_seen = 0
        self._last: tuple[float, str] | None = None
        #: seconds trained and lost so far (the counters' totals, for the ratio)
        self._trained = self._lost = 0.0
        self._shown: set[tuple[Gauge, tuple[str, str]]] = set()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- the values -----------------------------------------------------------------------------------

    def update(self, snapshot: dict, events: list[dict]) -> None:
        """The metrics from the latest status ``snapshot`` and the event log's ``events`` (those not read before)."""
        now = self.clock()
        if snapshot:
            self._time(now, snapshot.get("phase", ""))
            self.steps_per_second.set(snapshot.get("steps_per_s") or 0.0)
            if snapshot.get("step") is not None:
                self.step.set(snapshot["step"])
            self.generation.set(snapshot.get("generation", 0))
            self.restarts_left.set(max(0, snapshot.get("max_restarts", 0) - snapshot.get("restarts_used", 0)))
            self._ranks(snapshot)
        for event in events[self._events_seen:]:
            self._event(event)
        self._events_seen = max(self._events_seen, len(events))

    def _time(self, now: float, phase: str) -> None:
        """Goodput: the time since the last update counts as training while the job ran, else as lost."""
        if self._last is not None and self._last[1] not in ("", "exiting", "done"):
            elapsed = max(0.0, now - self._last[0])
            if self._last[1] == "running":
                self._trained += elapsed
                self.training.inc(elapsed)
            else:
                self._lost += elapsed
                self.lost.inc(elapsed)
        self._last = (now, phase)
        total = self._trained + self._lost
        self.goodput.set(self._trained / total if total > 0 else 1.0)

    def _ranks(self, snapshot: dict) -> None:
        shown: set[tuple[Gauge, tuple[str, str]]] = set()
        for r in snapshot.get("ranks", ()):
            if r.get("node") is None:
                continue
            key = (str(r["rank"]), str(r["node"]))
            score = self.outside_score if r.get("straggler_view") == "outside" else self.straggler_score
            for gauge, value in ((self.rank_step, r.get("step_s")), (self.rank_compute, r.get("compute_s")),
                                 (self.rank_wait, r.get("wait_s")), (score, r.get("straggler_score")),
                                 (self.rank_cpu, r.get("cpu_s_per_s"))):
                if value is not None:
                    gauge.labels(*key).set(value)
                    shown.add((gauge, key))
        for gauge, gone in self._shown - shown:  # a rank that moved to another node, or no longer measured: its series goes
            try:
                gauge.remove(*gone)
            except KeyError:
                pass
        self._shown = shown
        for node in snapshot.get("nodes", ()):
            if node.get("straggler_score") is not None:
                self.node_straggler_score.labels(str(node["node"])).set(node["straggler_score"])
        self.stragglers.set(len(snapshot.get("stragglers", ())))

    def _event(self, event: dict) -> None:
        kind = event.get("kind")
        if kind == "fault":
            evidence = event.get("evidence") or {}
            self.faults.labels(evidence.get("cause") or "exit", evidence.get("level") or "").inc()
        elif kind == "node_lost":
            self.faults.labels("node_lost", "").inc()
        elif kind == "straggler" and event.get("named"):
            self.faults.labels("straggler", "").inc()
        elif kind == "repair_done":
            level = event.get("level", "")
            self.repairs.labels(level).inc()
            self.repair_seconds.labels(level).observe(event.get("total", 0.0))
            for phase, seconds in (event.get("durations") or {}).items():
                self.repair_phase_seconds.labels(level, phase).observe(seconds)

    # -- the endpoint ---------------------------------------------------------------------------------

    def serve(self, port: int, address: str = "") -> int:
        """Serve ``/metrics`` on ``port`` (all addresses unless ``address``) in a thread; the port it listens on."""
        self._server = http.server.ThreadingHTTPServer((address, port), MetricsHandler.factory(self.registry))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="ftrun-metrics", daemon=True)
        self._thread.start()
        bound = self._server.server_address[1]
        log.info("Prometheus metrics at http://%s:%d/metrics", address or "0.0.0.0", bound)
        return int(bound)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
