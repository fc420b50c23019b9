"""``ftrun probe`` (alias ``ftrun doctor``): this node's devices, their health, and what ftrun would do."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from typing import Mapping, NamedTuple

import click
from rich.table import Table

from ftrun.cli.console import console, out
from ftrun.cli.launch import CLUSTER, DEVICES, NODES, RDZV, option, remote_host_options
from ftrun.config import DEFAULT_RDZV_PORT, DEFAULTS, conf_is_host, parse_endpoint, parse_rdzv_conf, positive_seconds
from ftrun.contract import Endpoint
from ftrun.detection.pairs import PAIR_BYTES
from ftrun.errors import ExitCode, UsageError
from ftrun.orphans import on_session_end


def _remote_host_options(fn):
    """The launch's flags for reaching the hostfile's hosts over ssh (``remote_host_options``)."""
    for decorator in reversed(remote_host_options()):
        fn = decorator(fn)
    return fn


HELP = """Show this node's devices: health, error codes, fault level, the rule that gave it (a fault
table file, MindCluster's code list, or the health fallback) and the action ftrun would take. On Ascend, also
the variables ftrun sets in the workers for process-level recovery, as this environment would have them.

\b
  ftrun probe
  ftrun probe --device npu --npu-smi /usr/local/bin/npu-smi --json

Exits 4 when a device is unfit for new work (or its health cannot be read), else 0.

Across the job's nodes: run it on every node with the launch's --nnodes and --rdzv-endpoint (the node on the
endpoint's host hosts the store). The nodes join one rendezvous, as --preflight's: each times its matmul,
the pairs of nodes measure the data network in rounds, and the node that hosts the store prints the table
(each node's matmul per device, each pair's bandwidth). One line per finding on every node; exits 4 when a
node would be left out (a slow matmul or data link, a peer it cannot reach, a device unfit).

\b
  ftrun probe --nnodes 4 --rdzv-endpoint head:29400 --speed

From a head node, once: --hostfile FILE (the launch's, with its SSH flags) runs it on every host of the file over
ssh, spares included, the first host hosting the store (at --rdzv-endpoint, else the first host's port 29400);
the head prints the table once and exits with the worst host's code.

\b
  ftrun probe --hostfile hosts.txt --ssh-port 2222
"""


@click.command(help=HELP, context_settings={"max_content_width": 110})
@option("device", group=DEVICES, default=DEFAULTS.device, show_default=True, help="auto, npu, cuda or cpu.")
@option("npu-smi", group=DEVICES, default=DEFAULTS.npu_smi, show_default=True, help="The npu-smi program to run.")
@option("device-timeout", group=DEVICES, type=float, default=DEFAULTS.device_timeout, show_default=True,
        help="Seconds the device tool may take.")
@option("fault-levels", group=DEVICES, default="", help="YAML file merged over ftrun's fault-level table.")
@click.option("--speed", is_flag=True,
              help="Also time a 512 x 512 matmul on each device, as --preflight does (a few seconds: torch's import).")
@option("nnodes", group=NODES, default="1", show_default=True,
        help="Check this many nodes together (each runs the command): matmul times and the data network's pairs.")
@option("rdzv-endpoint", group=RDZV, default="", help="HOST:PORT where the nodes meet (with --nnodes above 1).")
@option("run-id", group=RDZV, default="probe", show_default=True, help="Id shared by the nodes of one check.")
@option("rdzv-timeout", group=RDZV, default=None,
        help=f"Seconds to wait for every node, as the launch's rendezvous does.  [default: {DEFAULTS.rdzv_timeout:g}]")
@option("rdzv-conf", group=RDZV, default="",
        help="key=value,...: is_host=1 makes this node host the store (0: join it), as the launch's.")
@option("hostfile", group=CLUSTER, default="",
        help="From this head node: run the check on every host of the file over ssh (the launch's hostfile).")
@_remote_host_options
@option("ssh-agent", group=CLUSTER, is_flag=True, hidden=True, envvar=None)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def probe_command(**params) -> int:
    from ftrun.config import device_options
    from ftrun.detection.preflight import MATMUL_SIZE, matmul_times
    from ftrun.detection.probe import probe
    from ftrun.detection.table import load_fault_table
    from ftrun.devices import DeviceOptions, make_device_backend

    if params["hostfile"]:
        return probe_from_head(params)
    if params["ssh_agent"]:
        on_session_end(_stop_with_the_session)
    is_host = conf_is_host(parse_rdzv_conf(params["rdzv_conf"]))
    count, endpoint = nodes_to_check(params)
    options = device_options(params)
    table = load_fault_table(options["fault_levels"] or None)
    backend = make_device_backend(options["device"], DeviceOptions(npu_smi=options["npu_smi"], timeout=options["device_timeout"]))
    report = probe(backend, table)
    settings = recovery_settings(os.environ) if report.kind == "npu" else []
    speed = matmul_times(report.kind, max(1, len(report.rows))) if params["speed"] or count > 1 else []
    if count > 1:
        from ftrun.probe_nodes import probe_nodes

        assert endpoint is not None
        found = probe_nodes(endpoint, count, params["run_id"], report.problem, speed, params["rdzv_timeout"], is_host)
        return show_nodes(report, found, params["as_json"])
    if params["as_json"]:
        out.print_json(json.dumps({**report.as_dict(), "recovery_env": [s._asdict() for s in settings],
                                   **({"matmul_ms": [round(t * 1000, 3) for t in speed]} if params["speed"] else {})}))
    else:
        show(report)
        show_settings(settings)
        if params["speed"]:
            times = ", ".join(f"{t * 1000:.1f} ms" for t in speed) or "could not be timed (see the warning above)"
            out.print(f"{report.kind}: a {MATMUL_SIZE} x {MATMUL_SIZE} matmul takes {times}", markup=False)
    return ExitCode.DEVICE if report.problem else ExitCode.OK


def nodes_to_check(params) -> tuple[int, Endpoint | None]:
    """How many nodes to check together, and where they meet (bad input: a UsageError, one line)."""
    text = str(params["nnodes"]).strip()
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"--nnodes must be a whole number of nodes, 1 or more (got {text!r})")
    count = int(text)
    if count == 1:
        return 1, None
    if not params["rdzv_endpoint"]:
        raise UsageError(f"--nnodes {count} needs --rdzv-endpoint HOST:PORT, where the nodes meet")
    given = params["rdzv_timeout"]
    params["rdzv_timeout"] = DEFAULTS.rdzv_timeout if given is None else positive_seconds(given, "--rdzv-timeout")
    return count, parse_endpoint(params["rdzv_endpoint"], DEFAULT_RDZV_PORT)


def show_nodes(report, found, as_json: bool) -> int:
    """The probe across nodes: the table (on the store's host), then one line per finding; the exit status."""
    result = {**report.as_dict(), **nodes_result(found)}
    if as_json:
        out.print_json(json.dumps(result))
    else:
        show(report)
        if found.hosted:
            show_tables(result)
        else:
            out.print("the table of every node is printed on the node that hosts the store", markup=False)
        show_findings(found.findings)
    return found.exit_code or (ExitCode.DEVICE if report.problem else ExitCode.OK)


def nodes_result(found) -> dict:
    """What the probe across nodes found, as ``--json`` gives it (and a head node reads it back)."""
    nodes = [{"host": n.host, "data": n.data_endpoint, "matmul_ms": [round(t * 1000, 3) for t in n.matmul_each]}
             for n in found.nodes]
    names = {n.agent_id: n.host for n in found.nodes}
    pairs = [{"a": names.get(p.a, p.a), "b": names.get(p.b, p.b), "ms": round(p.seconds * 1000, 3) if p.seconds > 0 else None,
              "mb_s": round(2 * PAIR_BYTES / p.seconds / 1e6, 1) if p.seconds > 0 else None}
             for p in found.pairs if p.seconds != 0]
    return {"nodes": nodes, "pairs": pairs, "findings": found.findings, "hosted": found.hosted}


def show_tables(result: dict) -> None:
    """Each node's matmul per device, and each pair's time on the data network (``nodes_result``'s)."""
    table = Table(title="the job's nodes", title_justify="left")
    for column in ("node", "data address", "matmul per device"):
        table.add_column(column)
    for node in result["nodes"]:
        table.add_row(node["host"], node["data"].rpartition(":")[0] or "-",
                      ", ".join(f"{t:.1f} ms" for t in node["matmul_ms"]) or "-")
    out.print(table)
    table = Table(title=f"the data network, {PAIR_BYTES >> 20} MiB each way a pair", title_justify="left")
    for column in ("from", "to", "time", "bandwidth"):
        table.add_column(column)
    for pair in result["pairs"]:
        table.add_row(pair["a"], pair["b"], f"{pair['ms']:.1f} ms" if pair["ms"] else "not reached",
                      f"{pair['mb_s']:.1f} MB/s" if pair["mb_s"] else "-")
    out.print(table)


def show_findings(findings: list[str]) -> None:
    for line in findings:
        out.print(f"preflight: {line}", style="bold red", markup=False)
    if not findings:
        out.print("preflight: every node fit", markup=False)


def probe_from_head(params) -> int:
    """``--hostfile``: the probe on every host over ssh (``ftrun.head.probe``), its table and findings once,
    the worst host's exit code; a host that gave no result, one line saying why."""
    from ftrun.cli.cluster import read_hosts, remote_spec, ssh_options
    from ftrun.cli.launch import agent_flags
    from ftrun.head.probe import findings, plan_probes, run_probes, store_endpoint, worst_exit_code

    if str(params["nnodes"]).strip() != "1":
        raise UsageError("--nnodes cannot be used with --hostfile: every host of the hostfile is checked")
    if params["rdzv_conf"]:
        raise UsageError("--rdzv-conf cannot be used with --hostfile: the first host hosts the store")
    if params["rdzv_timeout"] is not None:
        positive_seconds(params["rdzv_timeout"], "--rdzv-timeout")
    hosts = read_hosts(params)
    endpoint = store_endpoint(hosts, params["rdzv_endpoint"])
    flags = tuple(agent_flags(probe_command, {k: v for k, v in params.items() if k != "as_json"}))
    agents = plan_probes(hosts, remote_spec(params, flags, (), ("probe",)), ssh_options(params), endpoint,
                         params["run_id"])
    probes = run_probes(agents)
    hosted = next((p.result for p in probes if p.result is not None and p.result.get("hosted")), None)
    found = findings(probes)
    complete = len(probes) == len(agents) and all(p.result is not None for p in probes)
    if params["as_json"]:
        out.print_json(json.dumps({"hosts": [dataclasses.asdict(p) for p in probes], "findings": found,
                                   **({"nodes": hosted["nodes"], "pairs": hosted["pairs"]} if hosted else {})}))
    else:
        if hosted is not None:
            show_tables(hosted)
        for probe in probes:
            if probe.result is None:
                console.print(f"ftrun: error: {probe.why}", style="bold red", markup=False)
        if complete:
            show_findings(found)
        elif len(probes) < len(agents):
            left = len(agents) - len(probes)
            console.print(f"ftrun: ended the probe on the {left} other host{'s' if left != 1 else ''}", markup=False)
    return worst_exit_code(p.exit_code for p in probes)


def _stop_with_the_session() -> None:
    """A probe a head node started: its session ended early (the head was interrupted, another host failed, or
    the head is gone), so nobody reads what it would find. Stop now, as on SIGTERM."""
    console.print("ftrun: the head node's ssh session closed; stopping", markup=False)
    os.kill(os.getpid(), signal.SIGTERM)


class Setting(NamedTuple):
    """A variable ftrun sets in an Ascend node's workers under ``--recovery process``, and why."""

    name: str
    value: str
    #: "ftrun", or "yours" where the environment's own value is kept
    set_by: str
    why: str


def recovery_settings(env: Mapping[str, str]) -> list[Setting]:
    """What the workers of this node would get for process-level recovery on Ascend (``workers.py``,
    ``mindspore.py``), with the user's own values where they win."""
    from ftrun import mindspore
    from ftrun.agent.workers import torch_npu_recovery_variables

    torch_npu = torch_npu_recovery_variables(env)
    handling = torch_npu.get("TORCH_HCCL_ASYNC_ERROR_HANDLING") or env.get("TORCH_HCCL_ASYNC_ERROR_HANDLING") \
        or env.get("HCCL_ASYNC_ERROR_HANDLING", "")
    tft = mindspore.recovery_variables(dict(env))["MS_ENABLE_TFT"]
    return [
        Setting("TORCH_HCCL_ASYNC_ERROR_HANDLING", handling, "ftrun" if torch_npu else "yours",
                "torch workers: a peer's communicator error reaches the rank's collective and the repair, instead of "
                "torch_npu's watchdog ending a healthy rank"),
        Setting("MS_ENABLE_TFT", tft, "yours" if "MS_ENABLE_TFT" in env else "ftrun",
                "MindSpore workers: its UCE and HCCL-error tagging, and a stopped step that fails (ARF, which also "
                "turns its HCCL watchdog off), which the repair's hooks need"),
        Setting("MS_ENABLE_RECOVERY", "1", "ftrun", "MindSpore workers: a replacement rejoins the running scheduler"),
    ]


def show_settings(settings: list[Setting]) -> None:
    if not settings:
        return
    table = Table(title="set in the workers under --recovery process", title_justify="left")
    for column in ("variable", "value", "set by", "why"):
        table.add_column(column)
    for setting in settings:
        table.add_row(*setting)
    out.print(table)


def show(report) -> None:
    if report.error:
        out.print(f"{report.kind}: device health unreadable: {report.error}", style="bold red", markup=False)
        return
    if not report.rows:
        out.print(f"{report.kind}: no accelerator to check", markup=False)
        return
    table = Table(title=f"{report.kind} devices", title_justify="left")
    for column in ("device", "name", "where", "health", "error codes", "level", "by", "ftrun would"):
        table.add_column(column)
    for row in report.rows:
        reading = row.reading
        style = None if row.usable else "bold red"
        if row.usable and row.level is not None:
            style = "yellow"
        table.add_row(
            str(reading.device.index), reading.device.name, reading.device.physical, reading.health.value,
            " ".join(reading.codes) or "-", row.level.value if row.level else "-", row.rule if row.level else "-",
            row.action, style=style,
        )
    out.print(table)
    for row in report.rows:
        if row.reading.info:
            out.print(f"device {row.reading.device.index}: {row.reading.info}", markup=False)
    if report.problem:
        out.print(f"unusable: {report.problem}", style="bold red", markup=False)
