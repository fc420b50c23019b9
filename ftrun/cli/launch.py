"""``ftrun [options] SCRIPT [args...]``: torchrun's flags, ftrun's own, and a YAML config."""

from __future__ import annotations

import os
import re

import click

from ftrun import __version__
from ftrun.config import (
    DEFAULT_NNODES,
    DEFAULT_NPROC_PER_NODE,
    DEFAULT_SIGNALS,
    DEFAULT_STREAMS,
    DEFAULTS,
    LOG_LAYOUTS,
    NUMA_MODES,
    RDZV_BACKENDS,
    RECOVERY_LEVELS,
    check_known_keys,
    read_config_file,
)
from ftrun.errors import UsageError
from ftrun.mindspore import FRAMEWORKS

#: help sections, in the order --help shows them
GROUPS = ("Nodes and processes", "Cluster (SSH, Slurm)", "Rendezvous", "Recovery", "Snapshots and checkpoints",
          "Devices and faults", "Worker command", "MindSpore (msrun's flags)", "Logs and output", "General")
_group_of: dict[str, str] = {}


def option(name: str, *, group: str, short: str | None = None, **kwargs):
    """A flag spelled ``--some-name`` and ``--some_name``, read from ``PET_SOME_NAME`` like torchrun."""
    names = [f"--{name}"]
    if "-" in name:
        names.append(f"--{name.replace('-', '_')}")
    if short:
        names.insert(0, short)
    dest = name.replace("-", "_")
    _group_of[dest] = group
    kwargs.setdefault("envvar", f"PET_{dest.upper()}")
    return click.option(*names, dest, **kwargs)


class GroupedCommand(click.Command):
    """Shows the options in sections, each under one spelling; notes the other spelling once."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {g: [] for g in GROUPS}
        for param in self.get_params(ctx):
            if not isinstance(param, click.Option) or param.hidden:
                continue
            group = _group_of.get(param.name, "General")
            names = [n for n in param.opts if "_" not in n.lstrip("-")]
            metavar = "" if param.is_flag else " " + param.make_metavar(ctx)
            text = param.help or ""
            if param.show_default and param.default not in (None, "", False):
                text += f"  [default: {param.default}]"
            sections[group].append((", ".join(names) + metavar, text))
        for group in GROUPS:
            if sections[group]:
                with formatter.section(group):
                    formatter.write_dl(sections[group])
        with formatter.section("Notes"):
            formatter.write_text(
                "Every --flag-name is also accepted as --flag_name, and read from the environment variable "
                "PET_FLAG_NAME when not given (as torchrun does). Precedence: flag, then PET_* variable, then "
                "--config file (also FTRUN_CONFIG), then the default. Everything after SCRIPT is passed to it untouched."
            )


RECOVERY = "Recovery"
CHECKPOINTS = "Snapshots and checkpoints"
NODES = "Nodes and processes"
RDZV = "Rendezvous"
WORKER = "Worker command"
DEVICES = "Devices and faults"
LOGS = "Logs and output"
CLUSTER = "Cluster (SSH, Slurm)"
MSRUN = "MindSpore (msrun's flags)"


def remote_host_options() -> list:
    """How a head node reaches its hostfile's hosts over ssh: the launch's flags, which ``ftrun probe
    --hostfile`` takes too."""
    return [
        option("include", group=CLUSTER, default="",
               help="Only these hosts (and slots) of the hostfile: 'h1@h2:0,2', Slurm ranges allowed (n[01-04])."),
        option("exclude", group=CLUSTER, default="", help="Leave out these hosts (or slots): 'h3@h2:1'."),
        option("ssh-port", group=CLUSTER, type=int, default=None, help="Port of the hosts' sshd.  [default: ssh's]"),
        option("ssh-option", group=CLUSTER, multiple=True,
               help="An ssh -o option (Name=Value), repeatable; wins over ftrun's BatchMode/ConnectTimeout."),
        option("remote-python", group=CLUSTER, default="",
               help="Python on the hosts.  [default: this ftrun's interpreter path]"),
        option("remote-cwd", group=CLUSTER, default="", help="Working folder on the hosts.  [default: the current one]"),
        option("env", group=CLUSTER, multiple=True,
               help="NAME or NAME=VALUE for the hosts' agents and workers, repeatable "
                    "(NCCL_*, HCCL_*, ASCEND_*, GLOO_*, PYTHONPATH are passed on anyway)."),
    ]


def launch_options(fn):
    decorators = [
        option("nnodes", group=NODES, default=DEFAULT_NNODES, show_default=True, help="Number of nodes, or MIN:MAX."),
        option("spares", group=NODES, type=int, default=DEFAULTS.spares, show_default=True,
               help="Spare nodes: agents that join beyond --nnodes stand by and take the place of a lost node."),
        option("nproc-per-node", group=NODES, default=DEFAULT_NPROC_PER_NODE, show_default=True,
               help="Workers per node: a number, or auto/cpu/gpu."),
        option("node-rank", group=NODES, type=int, default=DEFAULTS.node_rank,
               help="This node's rank (assigned at rendezvous when not given)."),
        option("standalone", group=NODES, is_flag=True, help="Single node: a local store on a free port, a fresh run id."),
        option("hostfile", group=CLUSTER, default="",
               help="Run from this head node: one agent per host over ssh (lines 'host slots=N [spare]' or "
                    "'host:N'; node ranks in file order). The store and the controller run here; with "
                    "--rdzv-backend etcd on a node etcd elects, and the job outlives this head."),
        *remote_host_options(),
        option("rdzv-host", group=CLUSTER, default="",
               help="Address the hosts reach this head node at.  [default: --local-addr, else the address on "
                    "the route to the first host]"),
        option("print-hosts", group=CLUSTER, is_flag=True,
               help="Print the hosts, slots and node ranks derived from --hostfile or Slurm, then exit."),
        option("dry-run", group=CLUSTER, is_flag=True,
               help="Print the commands ftrun would run on each host (or for each local rank), then exit."),
        option("ssh-agent", group=CLUSTER, is_flag=True, hidden=True, envvar=None),
        option("detached-agent", group=CLUSTER, is_flag=True, hidden=True, envvar=None),
        option("rdzv-backend", group=RDZV, default=DEFAULTS.rdzv_backend, show_default=True,
               help=f"Rendezvous backend: {', '.join(RDZV_BACKENDS)}.  c10d's store lives on one node, and losing "
                    "that node ends the job; with etcd any node may go (see README \"High availability\")."),
        option("rdzv-endpoint", group=RDZV, default="",
               help="HOST:PORT of the store; the agent on HOST that binds it first hosts it.  With etcd: its "
                    "members, HOST:PORT,HOST:PORT,..."),
        option("run-id", group=RDZV, default="", help="Job id shared by every node (alias: --rdzv-id)."),
        option("rdzv-id", group=RDZV, default="", help="Same as --run-id (torchrun's name)."),
        option("rdzv-conf", group=RDZV, default="",
               help="key=value,... (join_timeout, last_call_timeout, is_host; with etcd: cacert, cert, key, "
                    "user, password, protocol)."),
        option("store-timeout", group=RDZV, type=float, default=DEFAULTS.store_timeout, show_default=True,
               help="With etcd: seconds the job trains on while etcd has no quorum, before it stops."),
        option("rdzv-timeout", group=RDZV, type=float, default=None,
               help=f"Seconds to wait for every node to join.  [default: {DEFAULTS.rdzv_timeout:g}]"),
        option("master-addr", group=RDZV, default=DEFAULTS.endpoint.host, show_default=True,
               help="Store host for the static rendezvous."),
        option("master-port", group=RDZV, type=int, default=DEFAULTS.endpoint.port, show_default=True,
               help="Port of the static rendezvous, which the workers see as MASTER_PORT."),
        option("worker-port-range", group=RDZV, default="",
               help="LO-HI: the ports ftrun opens itself (the control and worker stores, snapshot servers) "
                    "are taken from this range; --master-port and --rdzv-endpoint keep their own port.  "
                    "[default: any free port]"),
        option("local-addr", group=RDZV, default="", help="Address this node advertises to the others."),
        option("store-bind", group=RDZV, default="",
               help="Address the stores this node hosts listen on; 0.0.0.0 for every interface.  "
                    "[default: the address the endpoint (or --local-addr) names]"),
        option("token-file", group=RDZV, default="",
               help="File with the job's secret (owner-only): every control message is signed with it, and "
                    "unsigned ones are ignored. Give every node the same file. [default: a head node makes one "
                    "for its agents; a single node makes its own]"),
        option("recovery", group=RECOVERY, default=DEFAULTS.recovery, show_default=True,
               help=f"Finest recovery level to try: {', '.join(RECOVERY_LEVELS)}."),
        option("max-restarts", group=RECOVERY, type=int, default=None,
               help=f"Job-wide retry budget (alias: --fault-retry-times).  [default: {DEFAULTS.max_restarts}]"),
        option("fault-retry-times", group=RECOVERY, type=int, default=None, help="Same as --max-restarts (MindCluster's name)."),
        option("monitor-interval", group=RECOVERY, type=float, default=DEFAULTS.monitor_interval, show_default=True,
               help="Seconds between checks of the workers (on Linux a worker's death is seen at once, and a "
                    "command from the controller always is)."),
        option("heartbeat-timeout", group=RECOVERY, type=float, default=DEFAULTS.heartbeat_timeout, show_default=True,
               help="Seconds without a heartbeat before a rank under ftrun.elastic counts as hung: its stack is "
                    "dumped, it is killed and recovered."),
        option("hang-timeout", group=RECOVERY, type=float, default=DEFAULTS.hang_timeout,
               help="Seconds without output and without CPU progress before a rank that does not use "
                    "ftrun.elastic counts as hung; 0 turns this off.  "
                    f"[default: {DEFAULTS.hang_timeout:g}]"),
        option("node-timeout", group=RECOVERY, type=float, default=DEFAULTS.node_timeout, show_default=True,
               help="Seconds without an agent's keepalive before its node counts as lost."),
        option("stop-timeout", group=RECOVERY, type=float, default=DEFAULTS.stop_timeout, show_default=True,
               help="Seconds between SIGTERM and SIGKILL when stopping workers (alias: --shutdown-timeout)."),
        option("shutdown-timeout", group=RECOVERY, type=float, default=None,
               envvar=["PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"],
               help="Same as --stop-timeout (torchrun's name; also TORCH_ELASTIC_SHUTDOWN_TIMEOUT)."),
        option("signals-to-handle", group=RECOVERY, default=DEFAULT_SIGNALS, show_default=True,
               help="Signals that stop the job, comma-separated. SIGINT and SIGTERM always do, and the "
                    "workers get SIGTERM; the workers get any other listed signal itself (SIGUSR1 for a Slurm "
                    "pre-emption), then SIGKILL after --stop-timeout."),
        option("stragglers", group=RECOVERY, default=DEFAULTS.stragglers, show_default=True,
               help="What ftrun does about a straggler (a rank whose compute time per step stays well past the "
                    "job's median, under ftrun.elastic): report names it in the status, ftrun top and the event "
                    "log; replace also moves its node's ranks to an idle spare at process level and says what it "
                    "gained; off watches nothing."),
        option("repair-timeout", group=RECOVERY, type=float, default=DEFAULTS.repair_timeout, show_default=True,
               help="Seconds a process-level repair may take before ftrun falls back to job level."),
        option("online-window", group=RECOVERY, type=float, default=DEFAULTS.online_window, show_default=True,
               help="Seconds a node's data link may stay dark (its collectives' interface without carrier) before "
                    "its ranks move to a spare node; back sooner, or with no spare, the job is repaired online the "
                    "moment it is back (no spare: a job-level restart after --repair-timeout)."),
        option("warm-standby", group=RECOVERY, type=int, default=None,
               help="1: each node keeps a warm interpreter (torch and the script's framework imported once, "
                    "about 300 MB of host memory) from which its ranks, their replacements and a job-level "
                    "restart's ranks are forked; 0: each rank starts in a fresh interpreter, as under torchrun. "
                    "(A larger number means 1: one warm interpreter serves every rank.)  "
                    "[default: 1 with --recovery process, else 0; a script whose text names neither torch nor a framework on it "
                    "starts fresh]"),
        option("no-integrations", group=RECOVERY, is_flag=True,
               help="Leave a script's Hugging Face or Lightning Trainer as it is: under --recovery process ftrun "
                    "otherwise turns its integration on as the Trainer is made (process level with no line "
                    "added). The workers get FTRUN_INTEGRATIONS=0; setting that yourself does the same."),
        option("snapshot-every", group=CHECKPOINTS, type=int, default=DEFAULTS.snapshots.every, show_default=True,
               help="Snapshot each rank's registered state into its node's shared memory after every K-th step "
                    "(ftrun.elastic); a job-level restart resumes from it. 0: no snapshots."),
        option("snapshot-replicas", group=CHECKPOINTS, type=int, default=DEFAULTS.snapshots.replicas, show_default=True,
               help="Peer nodes (the next in node order) that keep a copy of each rank's pinned snapshots."),
        option("replicate-every", group=CHECKPOINTS, type=int, default=DEFAULTS.snapshots.replicate_every, show_default=True,
               help="Steps between pinned snapshots, the ones copied to peers and to disk (a multiple of "
                    "--snapshot-every)."),
        option("snapshot-memory", group=CHECKPOINTS, default=None,
               help="Shared memory the node's snapshots may take (512M, 4G).  [default: half of what /dev/shm "
                    "has free]"),
        option("checkpoint-dir", group=CHECKPOINTS, default="",
               help="Folder the agents write pinned snapshots to, in the background (torch.save files and a "
                    "manifest per step)."),
        option("checkpoint-every", group=CHECKPOINTS, type=int, default=DEFAULTS.snapshots.checkpoint_every, show_default=True,
               help="Steps between checkpoints on disk (a multiple of --replicate-every)."),
        option("checkpoint-interval", group=CHECKPOINTS, type=float, default=DEFAULTS.snapshots.checkpoint_interval,
               help="Also write a checkpoint once the last one is this many seconds old (at the next pinned "
                    "snapshot); 0: only every --checkpoint-every steps.  "
                    f"[default: {DEFAULTS.snapshots.checkpoint_interval:g}]"),
        option("keep-checkpoints", group=CHECKPOINTS, type=int, default=DEFAULTS.snapshots.keep, show_default=True,
               help="Checkpoints kept on disk; older ones are deleted."),
        option("save-on-failure", group=CHECKPOINTS, is_flag=True,
               help="When a fault stops ranks, write every rank's snapshots in memory (its two newest) to "
                    "--checkpoint-dir too."),
        option("device", group=DEVICES, default=DEFAULTS.device, show_default=True,
               help="Device kind to watch and assign: auto (npu if npu-smi is on PATH, cuda if nvidia-smi is), "
                    "npu, cuda or cpu."),
        option("npu-smi", group=DEVICES, default=DEFAULTS.npu_smi, show_default=True, help="The npu-smi program to run."),
        option("device-timeout", group=DEVICES, type=float, default=DEFAULTS.device_timeout, show_default=True,
               help="Seconds a device tool (npu-smi, nvidia-smi) may take before it is killed."),
        option("reset-wait", group=DEVICES, type=float, default=DEFAULTS.reset_wait, show_default=True,
               help="Seconds to wait after a device reset before reading its health again (npu-smi asks for "
                    "at least 20)."),
        option("health-interval", group=DEVICES, type=float, default=DEFAULTS.health_interval, show_default=True,
               help="Seconds between device health polls (in a thread of their own)."),
        option("fault-levels", group=DEVICES, default="",
               help="YAML file merged over ftrun's fault-level table (error codes, health, error strings)."),
        option("device-ips", group=DEVICES, default="",
               help="YAML file of each host's device RoCE addresses ({host: {device id: IP}}) for the HCCL "
                    "rank table, where hccn_tool is not installed."),
        option("devices", group=DEVICES, default="",
               help="Only these device ids on this node (0,2,3), as npu-smi or nvidia-smi number them."),
        option("numa-binding", group=DEVICES, type=click.Choice(NUMA_MODES), default=None,
               help="Bind each worker to the CPUs near its device (npu-smi or nvidia-smi topology): node (the "
                    "device's NUMA node), socket, exclusive (the node's CPUs shared out among its devices' "
                    "workers) or core-complex (one L3 cache group)."),
        option("virtual-local-rank", group=DEVICES, is_flag=True,
               help="Every worker sees LOCAL_RANK 0 and only its own device (CUDA_VISIBLE_DEVICES or "
                    "ASCEND_RT_VISIBLE_DEVICES narrowed to it)."),
        option("preflight", group=DEVICES, is_flag=True,
               help="Check every node's devices (as ftrun probe) before training; an unusable device stops the job."),
        option("module", group=WORKER, short="-m", is_flag=True, help="Run SCRIPT as a module (python -m)."),
        option("no-python", group=WORKER, is_flag=True, help="Run SCRIPT as a program, without python."),
        option("run-path", group=WORKER, is_flag=True, help="Run SCRIPT with runpy.run_path."),
        option("framework", group=WORKER, default="",
               help=f"The workers' contract: {', '.join(FRAMEWORKS)}. mindspore launches as msrun does: a scheduler "
                    "per generation, MS_* variables (README \"MindSpore\").  [default: mindspore for a script that "
                    "imports mindspore and not torch, else torch]"),
        option("python", group=WORKER, default="",
               help="The python that runs the workers.  [default: ftrun's own; for mindspore, python on PATH "
                    "when ftrun's own cannot import mindspore]"),
        option("worker-num", group=MSRUN, default=None,
               help="msrun's: workers in the whole job (with --local-worker-num: --nnodes).  [default: 8]"),
        option("local-worker-num", group=MSRUN, default=None,
               help="msrun's: workers on this node (--nproc-per-node).  [default: 8]"),
        option("cluster-time-out", group=MSRUN, default=None,
               help=f"msrun's: seconds the MindSpore cluster waits for its members (MS_TOPO_TIMEOUT); negative: "
                    f"for ever.  [default: {DEFAULTS.cluster_timeout}]"),
        option("bind-core", group=MSRUN, default=None,
               help="msrun's: True binds each worker to CPUs near its device (--numa-binding exclusive)."),
        option("bind-numa", group=MSRUN, default=None,
               help="msrun's: True binds each worker to its device's NUMA node (--numa-binding node)."),
        option("tail-worker-log", group=MSRUN, default=None,
               help="msrun's: the workers (global ranks, 0,1) whose output the console shows; this node's "
                    "--local-ranks-filter.  [default: -1, every worker]"),
        option("worker-log-name", group=MSRUN, default=None,
               help="msrun's: accepted; ftrun names its log files itself, a folder per node and restart."),
        option("join", group=MSRUN, default=None, help="msrun's: accepted; ftrun always stays with its job."),
        option("rank-table-file", group=MSRUN, default=None,
               help="msrun's: refused; ftrun writes RANK_TABLE_FILE itself, fresh at every restart."),
        option("sim-level", group=MSRUN, default=None,
               help="msrun's dry run: refused, with the command that runs it without a launcher."),
        option("sim-rank-id", group=MSRUN, default=None, help="msrun's dry run's rank: refused, as --sim-level."),
        option("role", group=WORKER, default=DEFAULTS.role, show_default=True, help="Role name given to the workers."),
        option("start-method", group=WORKER, type=click.Choice(("spawn", "fork", "forkserver")), default=None,
               help="Accepted for torchrun's scripts: ftrun starts a fresh interpreter (or forks the warm one: --warm-standby)."),
        option("log-dir", group=LOGS, default="", help="Folder for per-rank logs and error files."),
        option("redirects", group=LOGS, short="-r", default=DEFAULT_STREAMS, show_default=True,
               help="Send streams to log files only: 1 stdout, 2 stderr, 3 both; or 0:1,1:2 per local rank."),
        option("tee", group=LOGS, short="-t", default=DEFAULT_STREAMS, show_default=True,
               help="Copy streams to log files too, lines prefixed [rank N] on the console; values as -r."),
        option("log-layout", group=LOGS, default=DEFAULTS.log_layout, show_default=True,
               help=f"Log folders and console prefixes: {', '.join(LOG_LAYOUTS)}. ftrun: DIR/RUN_ID/nodeN/attempt_G/RANK/ "
                    "and [rank N]; torchrun: DIR/RUN_ID_XXXXXXXX/attempt_G/LOCAL_RANK/ and [default0]:, as torchrun "
                    "writes them, the event log in that one folder too."),
        option("local-ranks-filter", group=LOGS, default="", help="Show only these local ranks' output on the console (0,1)."),
        option("duplicate-stdout-filters", group=LOGS, default="",
               help="Also copy workers' stdout lines that hold any of these words (a,b; ',,' for a comma) to "
                    "filtered_stdout.log in the attempt's log folder."),
        option("duplicate-stderr-filters", group=LOGS, default="",
               help="The same for stderr, into filtered_stderr.log."),
        option("logs-specs", group=LOGS, default="",
               help="Accepted for torchrun's scripts: ftrun has no LogsSpecs plugins (see --log-dir, --tee)."),
        option("event-log-handler", group=LOGS, default="",
               help="Accepted for torchrun's scripts: ftrun writes its events to events.jsonl in the run's log "
                    "folder (LOG_DIR/RUN_ID/; with --log-layout torchrun, LOG_DIR/RUN_ID_XXXXXXXX/)."),
        option("status", group=LOGS, default=DEFAULTS.status, show_default=True,
               help="The job's status where the controller runs: live (ftrun top's interactive view when the "
                    "terminal is stdin too; else a view "
                    "redrawn in place), plain (log lines and a progress line every 30s), off, or auto (live on a "
                    "terminal, else plain)."),
        option("metrics-port", group=LOGS, type=int, default=DEFAULTS.metrics_port, show_default=True,
               help="Serve Prometheus metrics (steps/s, step and wait times, straggler scores, faults, repairs, "
                    "restarts left, goodput) at http://HOST:PORT/metrics on the node that runs the controller; "
                    "0: none."),
        option("config", group="General", default="", envvar="FTRUN_CONFIG",
               help="YAML file of option values (keys as the flags: nproc_per_node: 2)."),
        click.version_option(__version__, "--version", prog_name="ftrun", message="%(prog)s %(version)s"),
        click.argument("script", required=False),
        click.argument("script_args", nargs=-1, type=click.UNPROCESSED),
    ]
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


#: options a config file may not set (they select the file or are handled by click)
NOT_IN_CONFIG = {"config", "ssh_agent", "detached_agent"}
#: second names of one option: alias -> the option it sets
ALIASES = {"rdzv_id": "run_id", "fault_retry_times": "max_restarts", "shutdown_timeout": "stop_timeout"}
#: torchrun's flags that mean nothing to ftrun: accepted, with one line saying what ftrun does instead
ACCEPTED_ONLY = {
    "start_method": "--start-method has no effect: ftrun starts each worker as a fresh interpreter "
                    "(or forks it from the node's warm interpreter: --warm-standby)",
    "logs_specs": "--logs-specs has no effect: ftrun has no LogsSpecs plugins; its logs follow --log-dir, "
                  "--tee and --redirects",
    "event_log_handler": "--event-log-handler has no effect: ftrun writes its events to events.jsonl in "
                         "the job's log folder (ftrun report reads it)",
}


def accepted_only_notes(values: dict) -> list[str]:
    """One line for each torchrun flag given that ftrun accepts but does not use."""
    return [text for name, text in ACCEPTED_ONLY.items() if values.get(name)]


def set_by_variables(ctx: click.Context) -> dict[str, str]:
    """Each option that an environment variable set (``PET_NNODES``, ``FTRUN_CONFIG``): its long flag ->
    that variable, so that an error about its value names what the user wrote."""
    found = {}
    for param in ctx.command.params:
        if param.name is None or ctx.get_parameter_source(param.name) is not click.core.ParameterSource.ENVIRONMENT:
            continue
        names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
        variable = next((name for name in names if os.environ.get(name)), names[0] if names else "")
        flag = next((o for o in param.opts if o.startswith("--")), "")
        if variable and flag:
            found[flag] = variable
    return found


def naming_variables(message: str, variables: dict[str, str]) -> str:
    """``message`` with each flag that a variable set replaced by that variable: "PET_NNODES must be N or
    MIN:MAX ..." rather than "--nnodes must be ...", which the user never typed."""
    for flag, variable in variables.items():
        message = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", variable, message)
    return message


def merge_config(ctx: click.Context, params: dict) -> dict:
    """Flags (and PET_* variables) override the config file, which overrides the defaults."""
    variables = set_by_variables(ctx)
    try:
        values = _merge_config(ctx, params)
    except UsageError as e:
        raise UsageError(naming_variables(e.message, variables)) from None
    #: the options environment variables set, for the errors of the checks that come later
    values["variables"] = variables
    return values


def _merge_config(ctx: click.Context, params: dict) -> dict:
    given = {k for k in params if ctx.get_parameter_source(k) not in (None, click.core.ParameterSource.DEFAULT)}
    values = {k: v for k, v in params.items() if k not in ALIASES}
    for alias, target in ALIASES.items():
        if alias in given and target in given and params[alias] != params[target]:
            raise UsageError(f"--{alias.replace('_', '-')} {params[alias]} and --{target.replace('_', '-')} "
                             f"{params[target]} set one option: give one of them")
        if alias in given and target not in given:
            values[target] = params[alias]
            given.add(target)
    path = params.get("config")
    from_file: dict = {}
    if path:
        try:
            from_file = read_config_file(path)
        except UsageError as e:
            if ctx.get_parameter_source("config") is click.core.ParameterSource.ENVIRONMENT:
                raise UsageError(f"FTRUN_CONFIG: {e.message}") from None
            raise
        check_known_keys(from_file, sorted(set(params) - NOT_IN_CONFIG), f"config file {path}")
        for alias, target in ALIASES.items():
            if alias in from_file and target in from_file and from_file[alias] != from_file[target]:
                raise UsageError(f"config file {path} sets {target} twice ({target}: {from_file[target]}, "
                                 f"{alias}: {from_file[alias]})")
        from_file = {ALIASES.get(k, k): _as_flag_value(ctx.command, k, v, f"config file {path}")
                     for k, v in from_file.items()}
        if "script" in given:  # a script on the command line comes with its own arguments
            from_file.pop("script_args", None)
        values.update((k, v) for k, v in from_file.items() if k not in given)
    if values.get("max_restarts") is None:
        values["max_restarts"] = DEFAULTS.max_restarts
    #: what the user set (flag, PET_* variable or config file), as against defaults
    values["given"] = frozenset(given | set(from_file))
    return values


def _as_flag_value(command: click.Command, name: str, value, where: str):
    """A config file's value as the flag would have given it: ``env: A=1`` is one value, not a list of
    letters, and ``devices: 0`` is the text "0", not a false-looking number. A list, mapping or
    true/false for an option that takes one value is refused: ``hostfile: true`` would be opened as
    file descriptor 1."""
    param = next((p for p in command.params if p.name == name), None)
    if param is None or value is None:
        return value
    if getattr(param, "is_flag", False):
        if not isinstance(value, (bool, str)):  # text is checked where it is read (config.switch)
            raise UsageError(f"{name} in {where} is a switch: true or false, got '{value}'")
        return value
    if getattr(param, "multiple", False):
        items = value if isinstance(value, list) else [value]
        return tuple(str(item) for item in items if item is not None)
    if param.nargs == -1:  # script_args: a list, or one string (config.parse_script_args checks)
        return value
    if isinstance(value, (bool, list, dict)):
        what = {"integer": "a whole number", "float": "a number"}.get(param.type.name, "text or a number")
        how = f"as after --{name.replace('_', '-')}" if isinstance(param, click.Option) else "as on the command line"
        raise UsageError(f"{name} in {where} must be {what} ({how}), got '{value}'")
    if param.type is click.STRING and isinstance(value, (int, float)):
        return str(value)
    return value


#: options only a head node reads (or sets per host itself); never passed on to the agents it starts
HEAD_ONLY = frozenset({
    "hostfile", "include", "exclude", "ssh_port", "ssh_option", "remote_python", "remote_cwd", "env", "rdzv_host",
    "print_hosts", "dry_run", "ssh_agent", "detached_agent", "config", "standalone", "master_addr", "master_port",
    "rdzv_endpoint", "rdzv_backend", "rdzv_conf", "node_rank", "nnodes", "nproc_per_node", "run_id", "rdzv_id",
    "local_addr", "devices", "spares", "store_bind", "token_file", "status", "start_method", "logs_specs",
    "event_log_handler",
})


def agent_flags(command: click.Command, values: dict) -> list[str]:
    """The head node's options that every agent it starts gets, as flags (defaults left out)."""
    flags: list[str] = []
    for param in command.params:
        if not isinstance(param, click.Option) or param.name in HEAD_ONLY or param.name not in values:
            continue
        value = values[param.name]
        if value is None or value == param.default or param.multiple and not value:
            continue
        name = next(o for o in param.opts if o.startswith("--"))
        if param.is_flag:
            flags += [name] if value else []
        else:
            for item in value if param.multiple else [value]:
                flags += [name, str(item)]
    return flags
