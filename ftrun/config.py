"""The launch configuration: every flag's value, checked once, typed, frozen.

The CLI gathers raw values (flags, a YAML file, PET_* variables); this module
turns them into a :class:`LaunchConfig` or raises :class:`UsageError` with one
line naming the problem.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import shlex
import shutil
import signal
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from ftrun import contract, mindspore
from ftrun.auth import read_token
from ftrun.contract import HEARTBEAT_TIMEOUT, STORE_TIMEOUT, Endpoint, EndpointError
from ftrun.detection.stragglers import STRAGGLER_ACTIONS
from ftrun.devices import DEVICE_KINDS, DeviceOptions, detect_kind
from ftrun.errors import UsageError
from ftrun.etcd import EtcdOptions
from ftrun.ports import PortRange, free_port, parse_port_range
from ftrun.snapshots.format import size_text
from ftrun.snapshots.keeper import SnapshotOptions, memory_root

RECOVERY_LEVELS = ("process", "job")
RDZV_BACKENDS = ("c10d", "static", "etcd")
#: torchrun's names of the etcd backend (its v2 one among them): ftrun's speaks etcd's v3 API
ETCD_SPELLINGS = ("etcd", "etcd-v2", "etcd-v3")
#: --rdzv-conf keys for the etcd backend, as torchrun's etcd rendezvous names them (user and password:
#: etcd's own authentication)
ETCD_CONF_KEYS = ("protocol", "cacert", "cert", "key", "user", "password")
#: --rdzv-conf keys: ftrun uses join_timeout, last_call_timeout, is_host and the etcd ones; torchrun's
#: others are accepted
RDZV_CONF_KEYS = (
    "join_timeout", "last_call_timeout", "is_host", "read_timeout", "close_timeout", "timeout",
    "keep_alive_interval", "keep_alive_max_attempt", "store_type", "use_libuv",
) + ETCD_CONF_KEYS
#: etcd's client port, for an --rdzv-endpoint member given without one
DEFAULT_ETCD_PORT = 2379
#: the most nodes, ranks per node, spares or standbys ftrun takes: more is a typo, and would only start
#: processes (or count node ranks) until the machine gives out
MAX_COUNT = 100_000
#: the longest wait ftrun takes, in seconds (31 years): Python's sleeps and waits overflow near 9.2e9
MAX_SECONDS = 1e9
#: torchrun's port for a c10d endpoint given without one
DEFAULT_RDZV_PORT = 29400


@dataclass(frozen=True)
class StreamSpec:
    """Which of a rank's streams go to files: bit 1 stdout, bit 2 stderr (torchrun's -r/-t)."""

    default: int = 0
    per_rank: tuple[tuple[int, int], ...] = ()

    def for_rank(self, local_rank: int) -> int:
        return dict(self.per_rank).get(local_rank, self.default)


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one ftrun agent needs to know, validated.

    Each field's default is its option's default, written here only: the CLI's flags and
    :func:`build_launch_config` read it from :data:`DEFAULTS` (the flags in the text they take).
    """

    #: the worker command before the script arguments
    entrypoint: tuple[str, ...] = ()
    script_args: tuple[str, ...] = ()
    #: --nnodes MIN:MAX
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    #: -1: assigned at rendezvous
    node_rank: int = -1
    #: the store; by default torchrun's static rendezvous (--master-addr, --master-port)
    endpoint: Endpoint = Endpoint("127.0.0.1", 29500)
    #: True/False when the user decided who hosts the store; None: first to bind the port
    is_host: bool | None = None
    rdzv_backend: str = "c10d"
    #: --rdzv-backend etcd: the cluster that holds the job's control state and elects its controller
    etcd: EtcdOptions | None = None
    #: --store-timeout: how long the job goes on without its control store (etcd without a quorum)
    #: before it stops
    store_timeout: float = STORE_TIMEOUT
    #: --run-id ("default" when none is given, as under torchrun)
    run_id: str = "default"
    #: --rdzv-timeout (or --rdzv-conf join_timeout): seconds to wait for every node to join
    rdzv_timeout: float = 600.0
    #: --rdzv-conf last_call_timeout
    last_call_timeout: float = 30.0
    recovery: str = "job"
    max_restarts: int = 0
    monitor_interval: float = 0.1
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    node_timeout: float = 30.0
    stop_timeout: float = 5.0
    repair_timeout: float = 60.0
    #: how long a dark data link may stay dark before its node's ranks move to a spare (ftrun.controller.links)
    online_window: float = 2.0
    #: 1: each node forks its ranks from a warm interpreter (torch already imported); 0: fresh interpreters, as
    #: torchrun starts them. build_launch_config derives it from --recovery (1 under process level) and --framework
    warm_standby: int = 0
    role: str = "default"
    local_addr: str = ""
    log_dir: str = ""
    redirects: StreamSpec = StreamSpec()
    tee: StreamSpec = StreamSpec()
    local_ranks_filter: frozenset[int] | None = None
    #: the device layer (ftrun.devices): auto, npu, cuda or cpu
    device: str = "auto"
    npu_smi: str = DeviceOptions.npu_smi
    #: seconds one device-tool call (npu-smi, nvidia-smi) may take
    device_timeout: float = DeviceOptions.timeout
    #: seconds to wait after a chip reset before reading device health again
    reset_wait: float = DeviceOptions.reset_wait
    health_interval: float = 5.0
    #: a user file merged over ftrun's fault-level table, or ""
    fault_levels: str = ""
    #: ranks without ftrun.elastic: no output and no CPU for this long counts as a hang; 0 = off
    hang_timeout: float = 0.0
    #: check every node's devices before training
    preflight: bool = False
    #: only these device ids on this node (None: every one found)
    devices: tuple[int, ...] | None = None
    #: started by a head node over ssh (c10d: stops when that session closes; etcd: detached from it), labels
    #: every output line with its rank
    head_managed: bool = False
    #: spare nodes the job keeps: agents beyond max_nodes stand by to replace a lost node
    spares: int = 0
    #: a YAML file of device RoCE addresses per host (for the HCCL rank table without hccn_tool), or ""
    device_ips: str = ""
    #: the controller's status display: auto, live, plain or off
    status: str = "auto"
    #: --store-bind: where the stores this node hosts listen ("" for the address the endpoint names)
    store_bind: str = ""
    #: the job's secret for signing control messages (--token-file; b"": unsigned)
    token: bytes = field(default=b"", repr=False)
    #: in-memory snapshots, their peer replicas and their persistence (--snapshot-every and the rest)
    snapshots: SnapshotOptions = field(default_factory=SnapshotOptions)
    #: the static rendezvous (--master-addr/--master-port): each generation's worker store listens on this
    #: port, so that workers see MASTER_PORT == --master-port (0: a fresh port per generation)
    worker_port: int = 0
    #: --worker-port-range: the ports ftrun opens itself (stores, snapshot servers); None: any free one
    worker_port_range: PortRange | None = None
    #: --signals-to-handle: signals that stop the job, each reaching the workers before the SIGKILL
    signals_to_handle: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    #: --virtual-local-rank: every worker sees LOCAL_RANK 0 and only its own device
    virtual_local_rank: bool = False
    #: not --no-integrations: under --recovery process a script's Trainer (Hugging Face's, Lightning's) gets
    #: ftrun's integration as it is made (ftrun/elastic/integrations/prepare.py)
    integrations: bool = True
    #: --numa-binding: how workers are bound to the CPUs near their device ("" = not bound)
    numa_binding: str = ""
    #: --duplicate-stdout-filters / --duplicate-stderr-filters: lines holding any of these words are also
    #: copied to the attempt's filtered_stdout.log / filtered_stderr.log
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    #: --log-layout: ftrun's folders and console prefixes, or torchrun's (ftrun.agent.output)
    log_layout: str = "ftrun"
    #: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: the teed lines' prefix (${role_name}, ${rank}, ${local_rank})
    log_line_prefix_template: str = ""
    #: --framework: the worker contract, torchrun's ("torch") or msrun's ("mindspore": a scheduler process
    #: per generation beside the worker store, MS_* variables; ftrun.mindspore)
    framework: str = "torch"
    #: --cluster_time_out (msrun's): seconds a MindSpore cluster waits for its members (MS_TOPO_TIMEOUT)
    cluster_timeout: int = mindspore.DEFAULT_CLUSTER_TIMEOUT
    #: --stragglers: what a straggler costs its node: report (name it), replace (its ranks move to a spare) or off
    stragglers: str = "report"
    #: --metrics-port: the controller serves Prometheus metrics on this port (0: none)
    metrics_port: int = 0

    @property
    def script(self) -> str:
        return self.entrypoint[-1]

    @property
    def several_nodes(self) -> bool:
        """Other agents may join this job (more nodes, or spares)."""
        return self.max_nodes > 1 or self.spares > 0


#: every option's default: the CLI's flags and build_launch_config read them here
DEFAULTS = LaunchConfig()
#: the defaults of the flags that a field is parsed from, as the flags write them (--nnodes 1, -r 0, ...)
DEFAULT_NNODES = str(DEFAULTS.max_nodes)  # min_nodes is the same: one number
DEFAULT_NPROC_PER_NODE = str(DEFAULTS.nproc_per_node)
DEFAULT_STREAMS = str(DEFAULTS.redirects.default)  # --redirects and --tee
DEFAULT_SIGNALS = ",".join(signal.Signals(number).name for number in DEFAULTS.signals_to_handle)


class _DuplicateKey(Exception):
    """A key given twice in one YAML mapping (PyYAML would silently keep the last value)."""

    def __init__(self, key: str, line: int, first: int):
        super().__init__(key)
        self.key, self.line, self.first = key, line, first


class _ConfigLoader(yaml.SafeLoader):
    """YAML 1.1 without base-60 numbers: ``nnodes: 2:4`` must stay the string "2:4", not 124.
    A key given twice is an error, not a silent choice of the last value."""

    def construct_mapping(self, node, deep=False):
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                line = key_node.start_mark.line + 1
                if key_node.value in seen:
                    raise _DuplicateKey(key_node.value, line, seen[key_node.value])
                seen[key_node.value] = line
        return super().construct_mapping(node, deep)


_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][-+]?[0-9]+)?$"),
    list("-+0123456789."),
)


def read_config_file(path: str) -> dict[str, Any]:
    """Read a YAML config file: a mapping of option names (``nproc_per_node: 2``)."""
    data = read_yaml_mapping(path, _ConfigLoader, "config file", "a mapping of option names to values")
    options: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in options:
            raise UsageError(f"config file {path} sets '{name}' twice (as '{spelled[name]}' and '{key}')")
        options[name], spelled[name] = value, str(key)
    return options


def read_yaml_mapping(path: str, loader: type, what: str, shape: str) -> dict:
    """A YAML file that must hold a mapping (or nothing); each problem is one UsageError naming
    ``what`` and the path."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{what} {path} is not UTF-8 text") from None
    return parse_yaml_mapping(text, loader, f"{what} {path}", shape)


def parse_yaml_mapping(text: str, loader: type, where: str, shape: str) -> dict:
    try:
        data = yaml.load(text, Loader=loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"{where} is not valid YAML{at}") from None
    except _DuplicateKey as e:
        raise UsageError(f"{where}, line {e.line}: key '{e.key}' is already given on line {e.first}") from None
    except (ValueError, TypeError, AttributeError, RecursionError) as e:
        # PyYAML's constructors raise these for values they cannot build: a 5000-digit number,
        # "2001-13-45", a !!timestamp tag on junk, lists nested thousands deep
        raise UsageError(f"{where} is not valid YAML ({str(e).split(':')[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{where} must be {shape}")
    return data


def check_known_keys(keys, known, where: str) -> None:
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UsageError(f"unknown key '{key}' in {where}{hint}")


def parse_nnodes(text: str) -> tuple[int, int]:
    """torchrun's ``--nnodes N`` or ``--nnodes MIN:MAX``."""
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise UsageError(f"--nnodes must be N or MIN:MAX with whole numbers, got '{text}'") from None
    if low < 1 or high < low:
        raise UsageError(f"--nnodes needs 1 <= MIN <= MAX, got '{text}'")
    if high > MAX_COUNT:
        raise UsageError(f"--nnodes must be at most {MAX_COUNT}, got '{text}'")
    return low, high


def parse_nproc(text: str) -> int:
    text = str(text).strip()
    if text in ("auto", "cpu", "gpu"):
        return _count_local_devices(text)
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"--nproc-per-node must be a positive number or auto/cpu/gpu, got '{text}'") from None
    if value < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, got {value}")
    if value > MAX_COUNT:
        raise UsageError(f"--nproc-per-node must be at most {MAX_COUNT}, got {value}")
    return value


def _count_local_devices(kind: str) -> int:
    # torchrun's rule: auto = accelerators if any, else CPUs. Device libraries load lazily.
    if kind in ("auto", "gpu"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        if kind == "gpu":
            raise UsageError("--nproc-per-node gpu: no CUDA device is visible")
    return os.cpu_count() or 1


def parse_endpoint(text: str, default_port: int, flag: str = "--rdzv-endpoint") -> Endpoint:
    """The contract's parser (ftrun.contract), its errors the user's: a usage error names the flag."""
    try:
        return contract.parse_endpoint(text, default_port, flag)
    except EndpointError as e:
        raise UsageError(str(e)) from None


def check_address(host: str, where: str) -> str:
    """A host name or address the resolver can take: socket calls raise UnicodeError, not the
    gaierror callers expect, for a label over 63 characters, an empty one, or bytes that are not UTF-8."""
    try:
        host.encode("idna")
    except UnicodeError:
        raise UsageError(f"{where}: '{host}' is not a host name or address") from None
    return host


def check_port(port: int, flag: str) -> None:
    if not 0 < port < 65536:
        raise UsageError(f"{flag}: port {port} is outside 1-65535")


def metrics_port(value: Any) -> int:
    """``--metrics-port``: 0 (or none) for no metrics endpoint, else a port."""
    port = whole_number(value or 0, "--metrics-port")
    if port:
        check_port(port, "--metrics-port")
    return port


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``key1=value1,key2=value2`` as torchrun's --rdzv-conf."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in str(text).split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--rdzv-conf entries must be key=value, got '{item}'")
        if key.strip() in conf:
            raise UsageError(f"--rdzv-conf gives '{key.strip()}' twice")
        conf[key.strip()] = value.strip()
    check_known_keys(conf, RDZV_CONF_KEYS, "--rdzv-conf")
    return conf


def conf_is_host(conf: dict[str, str]) -> bool | None:
    """--rdzv-conf's is_host: whether this node must host the store (True), must join it (False), or hosts
    it when the endpoint names this machine and its port is free (None, not given)."""
    if "is_host" not in conf:
        return None
    return conf["is_host"].lower() in ("1", "true", "yes")


def parse_streams(text: str, flag: str) -> StreamSpec:
    """torchrun's ``-r/-t``: ``3`` for every rank, or ``0:1,1:2`` per local rank."""
    text = str(text).strip()
    try:
        if ":" not in text:
            return StreamSpec(default=_stream_bits(text))
        per_rank: dict[int, int] = {}
        for item in text.split(","):
            rank, _, bits = item.partition(":")
            if int(rank) < 0 or int(rank) in per_rank:
                raise ValueError(rank)  # a negative rank matches nothing; a second one hides the first
            per_rank[int(rank)] = _stream_bits(bits)
        return StreamSpec(per_rank=tuple(per_rank.items()))
    except ValueError:
        raise UsageError(f"{flag} must be 0-3 or LOCAL_RANK:0-3,... (1 stdout, 2 stderr, 3 both), got '{text}'") from None


def _stream_bits(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 3:
        raise ValueError(text)
    return value


def _warm_standby(value: Any, recovery: str) -> int:
    if value is None or value == "":
        # on under process level: every rank, replacement and restart of the node is forked from its warm
        # interpreter, which imported torch once (ftrun/agent/forkserver.py), where the script imports torch. At
        # job level the ranks start fresh, as torchrun's do (a forked rank's /proc environ and cmdline are the
        # warm interpreter's, which tools that look for a rank's RANK there would not find)
        return 1 if recovery == "process" else 0
    return whole_number(value, "--warm-standby", maximum=MAX_COUNT)


def parse_script_args(value: Any) -> tuple[str, ...]:
    """The script's arguments: a list, or (from a config file) one string split like a shell would."""
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as e:
            raise UsageError(f"script_args: {e}") from None
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in value):
        return tuple(str(v) for v in value)
    raise UsageError(f"script_args must be a list of strings or one string, got '{value}'")


def parse_rank_filter(text: str | frozenset[int] | None) -> frozenset[int] | None:
    """--local-ranks-filter's text; a set as is (msrun's --tail_worker_log, mapped onto this node's local
    ranks, may leave none of them: nothing shown, where the empty text shows every rank)."""
    if isinstance(text, frozenset):
        return text
    text = str(text or "").strip()
    if not text:
        return None
    try:
        ranks = frozenset(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--local-ranks-filter must be comma-separated local ranks, got '{text}'") from None
    if any(r < 0 for r in ranks):
        raise UsageError(f"--local-ranks-filter ranks must be >= 0, got '{text}'")
    return ranks


def positive_seconds(value: Any, flag: str, allow_zero: bool = False) -> float:
    try:
        if isinstance(value, bool):  # a config file's `true` is not one second
            raise TypeError
        seconds = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{flag} must be a number of seconds, got '{value}'") from None
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise UsageError(f"{flag} must be a positive number of seconds, got '{value}'")
    if seconds > MAX_SECONDS:
        raise UsageError(f"{flag} must be at most {MAX_SECONDS:g} seconds, got '{value}'")
    return seconds


def whole_number(value: Any, flag: str, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool):
        raise UsageError(f"{flag} must be a whole number, got '{value}'")
    try:
        number = int(str(value).strip())
    except ValueError:
        raise UsageError(f"{flag} must be a whole number, got '{value}'") from None
    if number < minimum:
        raise UsageError(f"{flag} must be at least {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise UsageError(f"{flag} must be at most {maximum}, got {number}")
    return number


#: --status: the controller's display (ftrun.live_view)
STATUS_MODES = ("auto", "live", "plain", "off")
#: --numa-binding: torchrun's modes (torch/numa/binding.py), ftrun.agent.numa says what each binds
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
#: --log-layout: ftrun's own (names the node), or torchrun's exact folders and prefixes
LOG_LAYOUTS = ("ftrun", "torchrun")


def parse_signals(text: Any) -> tuple[int, ...]:
    """``--signals-to-handle SIGTERM,SIGUSR1`` (also ``USR1`` or a number), in the order given."""
    found: list[int] = []
    for item in filter(None, (part.strip() for part in str(text).split(","))):
        name = item.upper() if item.upper().startswith("SIG") else f"SIG{item.upper()}"
        try:
            number = signal.Signals(int(item)) if item.isascii() and item.isdigit() else signal.Signals[name]
        except (KeyError, ValueError):
            raise UsageError(f"--signals-to-handle: '{item}' is not a signal name (SIGUSR1, SIGTERM, ...)") from None
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise UsageError(f"--signals-to-handle: {number.name} cannot be caught, so it cannot be forwarded")
        if number not in found:
            found.append(number)
    return tuple(found)


def parse_filters(text: Any) -> tuple[str, ...]:
    """torchrun's ``--duplicate-*-filters a,b``: words, a doubled comma standing for a comma."""
    placeholder = "\0"
    items = str(text or "").replace(",,", placeholder).split(",")
    return tuple(item.replace(placeholder, ",") for item in items if item)


def choice(value: Any, choices: tuple[str, ...], flag: str) -> str:
    text = str(value).strip().lower()
    if text not in choices:
        raise UsageError(f"{flag} must be one of {', '.join(choices)}, got '{value}'")
    return text


def switch(raw: Mapping[str, Any], name: str) -> bool:
    """An on/off option: a flag gives a bool, and so must a config file (bool("no") is True)."""
    value = raw.get(name)
    if value is not None and not isinstance(value, bool):
        raise UsageError(f"{name} is a switch: true or false, got '{value}'")
    return bool(value)


def build_entrypoint(script: str, module: bool, no_python: bool, run_path: bool,
                     check_script: bool = True, python: str = "") -> tuple[str, ...]:
    """The worker command before the script's own arguments (torchrun's rules); ``python`` runs it
    ("": ftrun's own interpreter)."""
    if sum((module, no_python, run_path)) > 1:
        raise UsageError("--module, --no-python and --run-path cannot be combined")
    if not script:
        raise UsageError("no training script given (ftrun [options] SCRIPT [args...])")
    import sys

    python = python or sys.executable
    if module:
        return (python, "-u", "-m", script)
    if no_python and check_script:
        if os.sep not in script and not shutil.which(script):
            raise UsageError(f"--no-python: program '{script}' is not on PATH")
        if os.sep in script and not os.access(script, os.X_OK):
            raise UsageError(f"--no-python: '{script}' is not an executable file")
    if no_python:
        return (script,)
    if check_script and not os.path.isfile(script):
        raise UsageError(f"training script '{script}' does not exist")
    if run_path:
        code = "import runpy,sys; sys.argv=sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        return (python, "-u", "-c", code, script)
    return (python, "-u", script)


def etcd_options(raw: Mapping[str, Any], conf: Mapping[str, str], standalone: bool) -> EtcdOptions:
    """--rdzv-backend etcd: its members (--rdzv-endpoint h1:2379,h2:2379,...) and --rdzv-conf's TLS and auth."""
    if standalone:
        raise UsageError("--standalone hosts its own store on this machine: drop --rdzv-backend etcd")
    text = str(raw.get("rdzv_endpoint") or "").strip()
    if not text:
        raise UsageError("--rdzv-backend etcd needs --rdzv-endpoint: the etcd members, host:port,host:port,...")
    members = tuple(parse_endpoint(member, DEFAULT_ETCD_PORT) for member in text.split(",") if member.strip())
    protocol = choice(conf.get("protocol") or ("https" if conf.get("cacert") else "http"), ("http", "https"),
                      "--rdzv-conf protocol")
    for name in ("cacert", "cert", "key"):
        if conf.get(name) and not os.path.isfile(conf[name]):
            raise UsageError(f"--rdzv-conf {name}: no such file: {conf[name]}")
    if conf.get("key") and not conf.get("cert"):
        raise UsageError("--rdzv-conf key needs cert (the client certificate it goes with)")
    if bool(conf.get("user")) != bool(conf.get("password")):
        raise UsageError("--rdzv-conf user and password go together")
    if protocol == "https" and not conf.get("cacert"):
        raise UsageError("--rdzv-conf protocol=https needs cacert (the CA that signed the etcd members' certificates)")
    return EtcdOptions(members, conf.get("cacert", ""), conf.get("cert", ""), conf.get("key", ""),
                       conf.get("user", ""), conf.get("password", ""))


def build_launch_config(raw: Mapping[str, Any], check_script: bool = True) -> LaunchConfig:
    """Check every raw option value and derive the launch configuration.

    ``check_script`` False: the script lives on other hosts (a head node's ``--remote-cwd``).
    """
    rdzv_conf = parse_rdzv_conf(raw.get("rdzv_conf") or "")
    standalone = switch(raw, "standalone")
    min_nodes, max_nodes = parse_nnodes(raw.get("nnodes", DEFAULT_NNODES))
    backend = choice(raw.get("rdzv_backend") or DEFAULTS.rdzv_backend, RDZV_BACKENDS + ETCD_SPELLINGS, "--rdzv-backend")
    backend = "etcd" if backend in ETCD_SPELLINGS else backend
    etcd = etcd_options(raw, rdzv_conf, standalone) if backend == "etcd" else None
    master_port = raw.get("master_port")  # 0 is a bad port, not "the default"
    master_port = whole_number(DEFAULTS.endpoint.port if master_port is None else master_port, "--master-port", 1)
    check_port(master_port, "--master-port")
    run_id = str(raw.get("run_id") or "").strip()
    node_rank = whole_number(raw.get("node_rank", DEFAULTS.node_rank), "--node-rank", -1)

    ports = parse_port_range(raw.get("worker_port_range"))
    is_host: bool | None = None
    worker_port = 0
    if standalone:
        if max_nodes != 1:
            raise UsageError("--standalone runs a single node; drop --nnodes or set it to 1")
        endpoint = Endpoint("localhost", free_port(ports))
        run_id = run_id or uuid.uuid4().hex[:12]
        is_host = True
    elif etcd is not None:
        # the control store is hosted by whichever agent etcd elects: this is where this one would listen
        endpoint = Endpoint(check_address(str(raw.get("local_addr") or ""), "--local-addr") or socket.gethostname(), 0)
    elif raw.get("rdzv_endpoint"):
        endpoint = parse_endpoint(str(raw["rdzv_endpoint"]), DEFAULT_RDZV_PORT)
        if backend == "static":
            is_host = node_rank == 0
    else:
        # torchrun's static rendezvous: --master-addr/--master-port, node ranks from --node-rank
        if backend != "static" and min_nodes != max_nodes:
            raise UsageError(f"--nnodes {min_nodes}:{max_nodes} (elastic) needs --rdzv-endpoint HOST:PORT, the store "
                             "the agents gather at (or --rdzv-backend etcd); without one ftrun uses torchrun's static "
                             "rendezvous (--master-addr, --master-port), which takes a fixed --nnodes")
        endpoint = Endpoint(check_address(str(raw.get("master_addr") or DEFAULTS.endpoint.host), "--master-addr"), master_port)
        backend = "static" if max_nodes > 1 or backend == "static" else backend
        worker_port = master_port  # the workers' MASTER_PORT, as under torchrun (ftrun.store._open_static)
        if max_nodes == 1:
            is_host = True
        elif backend == "static":
            is_host = node_rank == 0
    if backend == "static":
        if min_nodes != max_nodes:
            raise UsageError("--rdzv-backend static needs a fixed --nnodes (no MIN:MAX)")
        if max_nodes > 1 and node_rank < 0:
            raise UsageError("--node-rank is required with the static rendezvous (or give --rdzv-endpoint)")
    if node_rank >= max_nodes:
        raise UsageError(f"--node-rank {node_rank} is out of range for --nnodes {max_nodes}")
    if "is_host" in rdzv_conf:
        is_host = conf_is_host(rdzv_conf)

    if raw.get("start_method"):  # accepted and unused (the CLI says so), but a typo is still one
        choice(raw["start_method"], ("spawn", "fork", "forkserver"), "--start-method")
    recovery = choice(raw.get("recovery") or DEFAULTS.recovery, RECOVERY_LEVELS, "--recovery")
    framework = framework_of(raw, check_script)
    devices = device_options(raw)
    if framework == "mindspore" and recovery == "process" and not mindspore_repairs_in_place(devices["device"],
                                                                                           devices["npu_smi"]):
        recovery = "job"  # off Ascend MindSpore cannot re-form its communication in a process (the CLI says so)
    if raw.get("rdzv_timeout") is not None:  # 0 is a bad timeout, not "the default"
        rdzv_timeout = positive_seconds(raw["rdzv_timeout"], "--rdzv-timeout")
    else:
        rdzv_timeout = positive_seconds(rdzv_conf.get("join_timeout") or DEFAULTS.rdzv_timeout, "join_timeout")
    nproc = parse_nproc(raw.get("nproc_per_node", DEFAULT_NPROC_PER_NODE))
    entrypoint = build_entrypoint(
        str(raw.get("script") or ""), switch(raw, "module"), switch(raw, "no_python"), switch(raw, "run_path"),
        check_script, worker_interpreter(raw, framework, check_script),
    )
    return LaunchConfig(
        entrypoint=entrypoint,
        script_args=parse_script_args(raw.get("script_args") or ()),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        node_rank=node_rank,
        endpoint=endpoint,
        is_host=is_host,
        rdzv_backend=backend,
        etcd=etcd,
        store_timeout=positive_seconds(raw.get("store_timeout", DEFAULTS.store_timeout), "--store-timeout"),
        run_id=run_id or DEFAULTS.run_id,
        rdzv_timeout=rdzv_timeout,
        last_call_timeout=positive_seconds(rdzv_conf.get("last_call_timeout", DEFAULTS.last_call_timeout),
                                           "last_call_timeout", True),
        recovery=recovery,
        max_restarts=whole_number(raw.get("max_restarts", DEFAULTS.max_restarts), "--max-restarts"),
        monitor_interval=positive_seconds(raw.get("monitor_interval", DEFAULTS.monitor_interval), "--monitor-interval"),
        heartbeat_timeout=positive_seconds(raw.get("heartbeat_timeout", DEFAULTS.heartbeat_timeout), "--heartbeat-timeout"),
        node_timeout=positive_seconds(raw.get("node_timeout", DEFAULTS.node_timeout), "--node-timeout"),
        stop_timeout=positive_seconds(raw.get("stop_timeout", DEFAULTS.stop_timeout), "--stop-timeout", True),
        repair_timeout=positive_seconds(raw.get("repair_timeout", DEFAULTS.repair_timeout), "--repair-timeout"),
        online_window=positive_seconds(raw.get("online_window", DEFAULTS.online_window), "--online-window"),
        # standbys import torch, which a MindSpore worker has no use for
        warm_standby=_warm_standby(raw.get("warm_standby"), recovery) if framework == "torch" else 0,
        role=str(raw.get("role") or DEFAULTS.role),
        local_addr=check_address(str(raw.get("local_addr") or ""), "--local-addr"),
        log_dir=os.path.abspath(raw["log_dir"]) if raw.get("log_dir") else "",
        redirects=parse_streams(raw.get("redirects", DEFAULT_STREAMS), "--redirects"),
        tee=parse_streams(raw.get("tee", DEFAULT_STREAMS), "--tee"),
        local_ranks_filter=parse_rank_filter(raw.get("local_ranks_filter")),
        head_managed=bool(raw.get("ssh_agent") or raw.get("detached_agent")),
        spares=whole_number(raw.get("spares") or DEFAULTS.spares, "--spares", maximum=MAX_COUNT),
        status=choice(raw.get("status") or DEFAULTS.status, STATUS_MODES, "--status"),
        store_bind=check_address(str(raw.get("store_bind") or "").strip(), "--store-bind"),
        token=read_token(str(raw["token_file"])) if raw.get("token_file") else b"",
        snapshots=snapshot_options(raw, ports),
        worker_port=worker_port,
        worker_port_range=ports,
        signals_to_handle=parse_signals(raw.get("signals_to_handle") or DEFAULT_SIGNALS),
        virtual_local_rank=switch(raw, "virtual_local_rank"),
        integrations=not switch(raw, "no_integrations"),
        numa_binding=choice(raw["numa_binding"], NUMA_MODES, "--numa-binding") if raw.get("numa_binding") else "",
        duplicate_stdout_filters=parse_filters(raw.get("duplicate_stdout_filters")),
        duplicate_stderr_filters=parse_filters(raw.get("duplicate_stderr_filters")),
        log_layout=choice(raw.get("log_layout") or DEFAULTS.log_layout, LOG_LAYOUTS, "--log-layout"),
        stragglers=choice(raw.get("stragglers") or DEFAULTS.stragglers, STRAGGLER_ACTIONS, "--stragglers"),
        metrics_port=metrics_port(raw.get("metrics_port")),
        log_line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", ""),
        framework=framework,
        cluster_timeout=_cluster_timeout(raw.get("cluster_timeout")),
        **devices,
    )


def mindspore_repairs_in_place(kind: str, npu_smi: str) -> bool:
    """Whether a MindSpore job's devices are Ascend NPUs (--device npu, or npu-smi found by --device auto):
    only there does MindSpore stop, clean and rebuild its communication in a running process
    (docs/mindspore.md shows the CPU build failing to)."""
    if kind != "auto":
        return kind == "npu"
    return detect_kind(DeviceOptions(npu_smi=npu_smi)) == "npu"


def framework_of(raw: Mapping[str, Any], check_script: bool = True) -> str:
    """--framework as given, else the one the script imports when that is certain
    (``mindspore.detect_framework``), else torch."""
    if raw.get("framework"):
        return choice(raw["framework"], mindspore.FRAMEWORKS, "--framework")
    script = str(raw.get("script") or "")
    if not check_script or not script or switch(raw, "module") or switch(raw, "no_python"):
        return DEFAULTS.framework
    found = mindspore.detect_framework(script)
    if found == "both":
        raise UsageError(f"{script} imports both torch and mindspore: say which launch it needs, --framework torch "
                         "(torchrun's) or --framework mindspore (msrun's)")
    return found or DEFAULTS.framework


def worker_interpreter(raw: Mapping[str, Any], framework: str, check: bool = True) -> str:
    """The python that runs the workers (--python; "" for ftrun's own). A MindSpore job's must import
    mindspore: --python's, else ftrun's own, else ``python`` on PATH as msrun's (``mindspore.worker_python``)."""
    given = str(raw.get("python") or "").strip()
    if given and check and not shutil.which(given):
        raise UsageError(f"--python: '{given}' is not an executable program")
    if framework != "mindspore" or not check or switch(raw, "no_python"):
        return given
    import sys

    found = mindspore.worker_python(given, sys.executable)
    if not found:
        tried = f"--python {given}" if given else f"neither {sys.executable}, ftrun's own, nor python on PATH"
        raise UsageError(f"--framework mindspore: the workers' python cannot import mindspore ({tried}); "
                         "give --python the interpreter of an environment that has it")
    return found


def _cluster_timeout(value: Any) -> int:
    """MS_TOPO_TIMEOUT: whole seconds; negative waits for ever (msrun's rule)."""
    if value is None or value == "":
        return DEFAULTS.cluster_timeout
    return whole_number(value, "--cluster_time_out", minimum=-MAX_COUNT)


#: --snapshot-memory's units (powers of 1024)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(value: Any, flag: str) -> int:
    """A size in bytes: 4096, 512M, 1.5G, 2GiB, 64k (powers of 1024)."""
    text = "" if isinstance(value, bool) else str(value).lower()
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text)
    if match is None:
        raise UsageError(f"{flag} must be a size such as 512M or 4G, got '{value}'")
    size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size <= 0:
        raise UsageError(f"{flag} must be more than 0 bytes, got '{value}'")
    return size


def free_memory(folder: str) -> int:
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def check_writable_folder(folder: str, flag: str) -> None:
    """``folder`` is a folder this process may write in, or one it may create."""
    if os.path.exists(folder):
        if not os.path.isdir(folder):
            raise UsageError(f"{flag} {folder} is not a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {folder} is not writable")
        return
    parent = os.path.dirname(os.path.abspath(folder))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {folder} cannot be created ({parent} is not a writable folder)")


def snapshot_options(raw: Mapping[str, Any], ports: PortRange | None = None) -> SnapshotOptions:
    """The snapshot flags, checked against each other and against this node's shared memory."""
    defaults = DEFAULTS.snapshots
    every = whole_number(raw.get("snapshot_every") or defaults.every, "--snapshot-every", maximum=MAX_COUNT)
    replicas = whole_number(raw.get("snapshot_replicas", defaults.replicas), "--snapshot-replicas", maximum=MAX_COUNT)
    replicate_every = whole_number(raw.get("replicate_every", defaults.replicate_every), "--replicate-every", 1, MAX_COUNT)
    checkpoint_every = whole_number(raw.get("checkpoint_every", defaults.checkpoint_every), "--checkpoint-every", 1, MAX_COUNT)
    keep = whole_number(raw.get("keep_checkpoints", defaults.keep), "--keep-checkpoints", 1, MAX_COUNT)
    interval = positive_seconds(raw.get("checkpoint_interval") or defaults.checkpoint_interval, "--checkpoint-interval",
                                allow_zero=True)
    folder = str(raw.get("checkpoint_dir") or "")
    save_on_failure = switch(raw, "save_on_failure")
    if folder and not every:
        raise UsageError("--checkpoint-dir writes ftrun's in-memory snapshots to disk: give --snapshot-every too")
    if folder:
        check_writable_folder(folder, "--checkpoint-dir")
    if save_on_failure and not folder:
        raise UsageError("--save-on-failure writes the ranks' snapshots to --checkpoint-dir: give it")
    if every and replicate_every % every:
        raise UsageError(f"--replicate-every {replicate_every} must be a multiple of --snapshot-every {every}")
    if folder and checkpoint_every % replicate_every:
        raise UsageError(f"--checkpoint-every {checkpoint_every} must be a multiple of "
                         f"--replicate-every {replicate_every}")
    given = raw.get("snapshot_memory") not in (None, "")
    memory = parse_size(raw["snapshot_memory"], "--snapshot-memory") if given else 0
    if every:
        root = memory_root()
        free = free_memory(root)
        if not given:
            memory = free // 2
        elif memory > free:
            raise UsageError(f"--snapshot-memory {size_text(memory)} is more than the {size_text(free)} free in {root}")
    return SnapshotOptions(every, replicas, replicate_every, memory, os.path.abspath(folder) if folder else "",
                           checkpoint_every, keep, save_on_failure, interval, ports)


def device_options(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The device layer's options, checked (shared by the launcher and ``ftrun probe``)."""
    return dict(
        device=choice(raw.get("device") or DEFAULTS.device, DEVICE_KINDS, "--device"),
        npu_smi=str(raw.get("npu_smi") or DEFAULTS.npu_smi),
        device_timeout=positive_seconds(raw.get("device_timeout", DEFAULTS.device_timeout), "--device-timeout"),
        reset_wait=positive_seconds(raw.get("reset_wait", DEFAULTS.reset_wait), "--reset-wait", True),
        health_interval=positive_seconds(raw.get("health_interval", DEFAULTS.health_interval), "--health-interval"),
        fault_levels=_existing_file(raw.get("fault_levels") or "", "--fault-levels"),
        hang_timeout=positive_seconds(raw.get("hang_timeout", DEFAULTS.hang_timeout), "--hang-timeout", True),
        preflight=switch(raw, "preflight"),
        devices=parse_device_list(raw.get("devices") or ""),
        device_ips=_existing_file(raw.get("device_ips") or "", "--device-ips"),
    )


def _existing_file(path: str, flag: str) -> str:
    """An absolute path to a file that exists, or "" when none was given."""
    path = str(path)
    if path and not os.path.isfile(path):
        raise UsageError(f"{flag}: file '{path}' does not exist")
    return os.path.abspath(path) if path else ""


def parse_device_list(text: str) -> tuple[int, ...] | None:
    """``--devices 0,2``: device ids, ascending; None when not given."""
    text = str(text).strip()
    if not text:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(re.fullmatch(r"[0-9]{1,9}", p) for p in parts):  # not isdigit(): int() refuses "²"
        raise UsageError(f"--devices must be device ids like 0,2,3, got '{text}'")
    return tuple(sorted({int(p) for p in parts}))
