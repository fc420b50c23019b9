"""The bad-input matrix: every flag, config key, hostfile line, environment variable and device-tool
output ftrun reads, fed a wrong value, gets one clear line and a documented exit code, never a traceback.

In-process: ``ftrun.cli.main(argv)`` with stderr captured. No case may start a job: ``Agent`` and
``Head`` are replaced by a stand-in that fails the test, so a value that slips through shows up as
"would have launched". The cases at the end ran each in a process of its own in
tests/integration/test_bad_input.py, which still runs the first of each table so, through ``python -m ftrun``.
"""

from __future__ import annotations

import logging
import io
import os
import socket
import sys
from pathlib import Path

import pytest

from ftrun.cli import launch_command, main
from ftrun.cli.launch import NOT_IN_CONFIG
from ftrun.devices import DeviceToolError, npu_smi
from ftrun.errors import ExitCode, UsageError
from ftrun.head.hosts import parse_host_filter, parse_hostfile
from ftrun.head.sessions import forwarded_env

USAGE = ExitCode.USAGE
#: text that came from bytes that are not UTF-8, as Python decodes argv and the environment
NON_UTF8 = os.fsdecode(b"\xff\xfe")
HUGE = str(10**30)
#: a 10 kB word
LONG = "x" * 10_000
#: more digits than int() reads (4300)
DIGITS = "9" * 5000
#: a host name whose one label is longer than DNS allows (63): the resolver raises UnicodeError for it
LONG_LABEL = "a" * 64

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "npu_smi"


class WouldLaunch(AssertionError):
    pass


class NoLaunch:
    """Takes the place of Agent and Head: a bad-input case must stop before either is built."""

    def __init__(self, *args, **kwargs):
        raise WouldLaunch("a bad-input case got as far as starting a job")


@pytest.fixture(autouse=True)
def sandbox(tmp_path, monkeypatch):
    """A clean environment and folder, no job can start, and main()'s global settings put back."""
    import ftrun.agent.agent
    import ftrun.cli.cluster

    monkeypatch.setattr(ftrun.agent.agent, "Agent", NoLaunch)
    monkeypatch.setattr(ftrun.cli.cluster, "Head", NoLaunch)
    saved_env = dict(os.environ)
    for name in list(os.environ):
        if name.startswith(("PET_", "SLURM_", "FTRUN_")) or name in ("MASTER_PORT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
            del os.environ[name]
    logger = logging.getLogger("ftrun")
    saved_logger = (list(logger.handlers), logger.level, logger.propagate)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("pass\n")
    yield
    os.environ.clear()
    os.environ.update(saved_env)
    logger.handlers[:], logger.level, logger.propagate = saved_logger


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    """Exit code and stderr of ``ftrun ARGV``; any exception but SystemExit is a traceback the user would see."""
    sys.stderr.reconfigure(errors="backslashreplace")  # as Python's own stderr: any text can be printed
    with pytest.raises(SystemExit) as leaving:
        main(argv)
    code = leaving.value.code
    return (0 if code is None else code), capsys.readouterr().err


def assert_one_clear_line(stderr: str, words: str | tuple[str, ...]) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ftrun: error: "), stderr
    for word in (words,) if isinstance(words, str) else words:
        assert word in lines[0], f"{word!r} not in {lines[0][:300]!r}"
    assert "Traceback" not in stderr


def expand(argv: list[str], tmp: Path) -> list[str]:
    return [str(tmp / "train.py") if a == "SCRIPT" else a.replace("{tmp}", str(tmp)) for a in argv]


# --- launch flags -------------------------------------------------------------------------------------

S = "SCRIPT"  # an existing script: the error must come from the flag, not from a missing file
FLAGS = [
    # (id, argv, words the error line must contain); every one exits 2
    ("nnodes-empty", ["--nnodes", "", S], "--nnodes"),
    ("nnodes-negative", ["--nnodes", "-1", S], ("--nnodes", "-1")),
    ("nnodes-huge", ["--nnodes", HUGE, "--rdzv-endpoint", "localhost:1", S], ("--nnodes", "at most")),
    ("nnodes-long", ["--nnodes", LONG, S], "--nnodes"),
    ("nnodes-digits", ["--nnodes", DIGITS, S], "--nnodes"),
    ("nnodes-non-utf8", ["--nnodes", NON_UTF8, S], "--nnodes"),
    ("nnodes-three-parts", ["--nnodes", "1:2:3", S], "'1:2:3'"),
    ("nnodes-fraction", ["--nnodes", "1.5", S], "'1.5'"),
    ("nnodes-open-min", ["--nnodes", ":2", S], "':2'"),
    ("nnodes-open-max", ["--nnodes", "2:", S], "'2:'"),
    ("nnodes-elastic-without-endpoint", ["--nnodes", "2:4", S], ("--nnodes 2:4 (elastic) needs --rdzv-endpoint", "static")),
    ("nnodes-zero-min", ["--nnodes", "0:2", S], "'0:2'"),
    ("nproc-empty", ["--nproc-per-node", "", S], "--nproc-per-node"),
    ("nproc-negative", ["--nproc-per-node", "-1", S], ("--nproc-per-node", "-1")),
    ("nproc-huge", ["--nproc-per-node", HUGE, S], ("--nproc-per-node", "at most")),
    ("nproc-long", ["--nproc-per-node", LONG, S], "--nproc-per-node"),
    ("nproc-non-utf8", ["--nproc_per_node", NON_UTF8, S], "--nproc-per-node"),
    ("nproc-fraction", ["--nproc-per-node", "2.5", S], "'2.5'"),
    ("node-rank-empty", ["--node-rank", "", S], "--node-rank"),
    ("node-rank-word", ["--node-rank", "first", S], ("--node-rank", "first")),
    ("node-rank-below-minus-one", ["--node-rank", "-2", S], ("--node-rank", "-2")),
    ("node-rank-huge", ["--node-rank", HUGE, S], ("--node-rank", HUGE)),
    ("node-rank-fraction", ["--node-rank", "0.5", S], "--node-rank"),
    ("node-rank-non-utf8", ["--node-rank", NON_UTF8, S], "--node-rank"),
    ("max-restarts-empty", ["--max-restarts", "", S], "--max-restarts"),
    ("max-restarts-fraction", ["--max-restarts", "1.5", S], "--max-restarts"),
    ("max-restarts-digits", ["--max-restarts", DIGITS, S], "--max-restarts"),
    ("max-restarts-non-utf8", ["--max-restarts", NON_UTF8, S], "--max-restarts"),
    ("max-restarts-and-alias-differ", ["--max-restarts", "1", "--fault-retry-times", "2", S],
     ("--fault-retry-times 2", "--max-restarts 1")),
    ("run-id-and-alias-differ", ["--run-id", "a", "--rdzv-id", "b", S], ("--rdzv-id b", "--run-id a")),
    ("monitor-interval-empty", ["--monitor-interval", "", S], "--monitor-interval"),
    ("monitor-interval-zero", ["--monitor-interval", "0", S], "--monitor-interval"),
    ("monitor-interval-nan", ["--monitor-interval", "nan", S], ("--monitor-interval", "nan")),
    ("monitor-interval-inf", ["--monitor-interval", "inf", S], ("--monitor-interval", "inf")),
    ("monitor-interval-huge", ["--monitor-interval", "1e300", S], ("--monitor-interval", "at most")),
    ("monitor-interval-word", ["--monitor-interval", "often", S], ("--monitor-interval", "often")),
    ("monitor-interval-non-utf8", ["--monitor-interval", NON_UTF8, S], "--monitor-interval"),
    ("node-timeout-zero", ["--node-timeout", "0", S], "--node-timeout"),
    ("node-timeout-negative", ["--node-timeout", "-1", S], "--node-timeout"),
    ("node-timeout-word", ["--node-timeout", "never", S], ("--node-timeout", "never")),
    ("node-timeout-huge", ["--node-timeout", "1e10", S], ("--node-timeout", "at most")),
    ("node-timeout-empty", ["--node-timeout", "", S], "--node-timeout"),
    ("stop-timeout-negative", ["--stop-timeout", "-1", S], "--stop-timeout"),
    ("stop-timeout-word", ["--stop-timeout", "soon", S], "--stop-timeout"),
    ("stop-timeout-inf", ["--stop-timeout", "inf", S], "--stop-timeout"),
    ("stop-timeout-huge", ["--stop-timeout", HUGE, S], ("--stop-timeout", "at most")),
    ("repair-timeout-zero", ["--repair-timeout", "0", S], "--repair-timeout"),
    ("repair-timeout-negative", ["--repair-timeout", "-5", S], "--repair-timeout"),
    ("repair-timeout-nan", ["--repair-timeout", "nan", S], "--repair-timeout"),
    ("repair-timeout-huge", ["--repair-timeout", "1e300", S], ("--repair-timeout", "at most")),
    ("online-window-zero", ["--online-window", "0", S], "--online-window"),
    ("online-window-nan", ["--online-window", "nan", S], "--online-window"),
    ("heartbeat-timeout-zero", ["--heartbeat-timeout", "0", S], "--heartbeat-timeout"),
    ("heartbeat-timeout-negative", ["--heartbeat-timeout", "-1", S], "--heartbeat-timeout"),
    ("heartbeat-timeout-word", ["--heartbeat-timeout", "x", S], "--heartbeat-timeout"),
    ("heartbeat-timeout-inf", ["--heartbeat-timeout", "inf", S], "--heartbeat-timeout"),
    ("hang-timeout-nan", ["--hang-timeout", "nan", S], "--hang-timeout"),
    ("hang-timeout-word", ["--hang-timeout", "off", S], "--hang-timeout"),
    ("hang-timeout-huge", ["--hang-timeout", "1e300", S], ("--hang-timeout", "at most")),
    ("health-interval-negative", ["--health-interval", "-1", S], "--health-interval"),
    ("health-interval-word", ["--health-interval", "x", S], "--health-interval"),
    ("health-interval-huge", ["--health-interval", "1e300", S], ("--health-interval", "at most")),
    ("device-timeout-zero", ["--device-timeout", "0", S], "--device-timeout"),
    ("device-timeout-negative", ["--device-timeout", "-1", S], "--device-timeout"),
    ("device-timeout-huge", ["--device-timeout", "1e300", S], ("--device-timeout", "at most")),
    ("device-timeout-non-utf8", ["--device-timeout", NON_UTF8, S], "--device-timeout"),
    ("rdzv-timeout-zero", ["--rdzv-timeout", "0", S], "--rdzv-timeout"),
    ("rdzv-timeout-negative", ["--rdzv-timeout", "-1", S], "--rdzv-timeout"),
    ("rdzv-timeout-nan", ["--rdzv-timeout", "nan", S], "--rdzv-timeout"),
    ("rdzv-timeout-huge", ["--rdzv-timeout", "1e300", S], ("--rdzv-timeout", "at most")),
    ("rdzv-timeout-word", ["--rdzv-timeout", "long", S], "--rdzv-timeout"),
    ("warm-standby-negative", ["--warm-standby", "-1", S], "--warm-standby"),
    ("warm-standby-huge", ["--warm-standby", HUGE, S], ("--warm-standby", "at most")),
    ("warm-standby-word", ["--warm-standby", "one", S], "--warm-standby"),
    ("warm-standby-empty", ["--warm-standby", "", S], "--warm-standby"),
    ("spares-negative", ["--spares", "-1", S], "--spares"),
    ("spares-huge", ["--spares", HUGE, S], ("--spares", "at most")),
    ("spares-word", ["--spares", "two", S], "--spares"),
    ("spares-fraction", ["--spares", "0.5", S], "--spares"),
    ("snapshot-every-negative", ["--snapshot-every", "-1", S], "--snapshot-every"),
    ("snapshot-every-word", ["--snapshot-every", "often", S], "--snapshot-every"),
    ("snapshot-every-huge", ["--snapshot-every", HUGE, S], ("--snapshot-every", "at most")),
    ("snapshot-replicas-negative", ["--snapshot-replicas", "-1", S], "--snapshot-replicas"),
    ("snapshot-replicas-huge", ["--snapshot-replicas", HUGE, S], ("--snapshot-replicas", "at most")),
    ("replicate-every-zero", ["--replicate-every", "0", S], "--replicate-every"),
    ("replicate-every-off-grid", ["--snapshot-every", "3", "--replicate-every", "10", S],
     ("--replicate-every 10", "multiple of --snapshot-every 3")),
    ("checkpoint-every-zero", ["--checkpoint-every", "0", S], "--checkpoint-every"),
    ("checkpoint-every-off-grid", ["--snapshot-every", "1", "--checkpoint-dir", "ckpt", "--checkpoint-every", "15", S],
     ("--checkpoint-every 15", "multiple of --replicate-every 10")),
    ("keep-checkpoints-zero", ["--keep-checkpoints", "0", S], "--keep-checkpoints"),
    ("checkpoint-interval-negative", ["--checkpoint-interval", "-1", S], "--checkpoint-interval"),
    ("checkpoint-interval-nan", ["--checkpoint-interval", "nan", S], "--checkpoint-interval"),
    ("checkpoint-interval-huge", ["--checkpoint-interval", "1e300", S], ("--checkpoint-interval", "at most")),
    ("snapshot-memory-word", ["--snapshot-every", "1", "--snapshot-memory", "lots", S],
     ("--snapshot-memory", "'lots'")),
    ("snapshot-memory-zero", ["--snapshot-every", "1", "--snapshot-memory", "0", S], "more than 0 bytes"),
    ("snapshot-memory-negative", ["--snapshot-every", "1", "--snapshot-memory", "-1G", S], "--snapshot-memory"),
    ("snapshot-memory-unit", ["--snapshot-every", "1", "--snapshot-memory", "4X", S], "--snapshot-memory"),
    ("snapshot-memory-over-free", ["--snapshot-every", "1", "--snapshot-memory", "900T", S],
     ("--snapshot-memory 900.0 TiB", "free in")),
    ("checkpoint-dir-without-snapshots", ["--checkpoint-dir", "ckpt", S], "give --snapshot-every too"),
    ("checkpoint-dir-is-a-file", ["--snapshot-every", "1", "--checkpoint-dir", "{tmp}/train.py", S],
     ("--checkpoint-dir", "not a folder")),
    ("checkpoint-dir-under-a-file", ["--snapshot-every", "1", "--checkpoint-dir", "{tmp}/train.py/ckpt", S],
     ("--checkpoint-dir", "cannot be created")),
    ("save-on-failure-without-dir", ["--snapshot-every", "1", "--save-on-failure", S], "--save-on-failure"),
    ("endpoint-blank", ["--rdzv-endpoint", "   ", S], "--rdzv-endpoint is empty"),
    ("endpoint-no-host", ["--rdzv-endpoint", ":29400", S], "has no host name"),
    ("endpoint-empty-port", ["--rdzv-endpoint", "head:", S], "port ''"),
    ("endpoint-port-zero", ["--rdzv-endpoint", "head:0", S], "port 0"),
    ("endpoint-port-negative", ["--rdzv-endpoint", "head:-1", S], "port -1"),
    ("endpoint-port-digits", ["--rdzv-endpoint", f"head:{DIGITS}", S], "is not a number"),
    ("endpoint-long-host", ["--rdzv-endpoint", f"{LONG}:29400", S], "is not a host name"),
    ("endpoint-long-label", ["--rdzv-endpoint", f"{LONG_LABEL}.example:29400", S], "is not a host name"),
    ("endpoint-empty-label", ["--rdzv-endpoint", "head..example:29400", S], "'head..example'"),
    ("endpoint-non-utf8", ["--rdzv-endpoint", f"{NON_UTF8}:29400", S], ("--rdzv-endpoint", "is not a host name")),
    ("rdzv-conf-no-key", ["--rdzv-conf", "=5", S], "--rdzv-conf"),
    ("rdzv-conf-unknown-key", ["--rdzv-conf", "join_timout=5", S], "unknown key 'join_timout'"),
    ("rdzv-conf-key-twice", ["--rdzv-conf", "join_timeout=5,join_timeout=9", S], "'join_timeout' twice"),
    ("rdzv-conf-join-word", ["--rdzv-conf", "join_timeout=abc", S], ("join_timeout", "'abc'")),
    ("rdzv-conf-join-negative", ["--rdzv-conf", "join_timeout=-1", S], ("join_timeout", "'-1'")),
    ("rdzv-conf-join-zero", ["--rdzv-conf", "join_timeout=0", S], ("join_timeout", "'0'")),
    ("rdzv-conf-last-call-word", ["--rdzv-conf", "last_call_timeout=x", S], "last_call_timeout"),
    ("rdzv-conf-last-call-negative", ["--rdzv-conf", "last_call_timeout=-1", S], "last_call_timeout"),
    ("rdzv-conf-non-utf8", ["--rdzv-conf", f"{NON_UTF8}=1", S], "--rdzv-conf"),
    ("rdzv-conf-long", ["--rdzv-conf", LONG, S], "--rdzv-conf"),
    ("rdzv-backend-unknown", ["--rdzv-backend", "zookeeper", S], ("--rdzv-backend", "zookeeper")),
    ("etcd-without-endpoint", ["--rdzv-backend", "etcd-v2", "--nnodes", "2", S], "needs --rdzv-endpoint"),
    ("etcd-member-port-word", ["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379,e2:x", "--nnodes", "2", S],
     "port 'x'"),
    ("etcd-user-without-password", ["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1", "--rdzv-conf", "user=u",
                                    "--nnodes", "2", S], "user and password go together"),
    ("etcd-cacert-missing", ["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1", "--rdzv-conf", "cacert=/no/ca.pem",
                             "--nnodes", "2", S], ("cacert", "/no/ca.pem")),
    ("etcd-https-without-cacert", ["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1", "--rdzv-conf",
                                   "protocol=https", "--nnodes", "2", S], "needs cacert"),
    ("etcd-standalone", ["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1", "--standalone", S], "--standalone"),
    ("store-timeout-zero", ["--store-timeout", "0", S], "--store-timeout"),
    ("rdzv-backend-non-utf8", ["--rdzv-backend", NON_UTF8, S], "--rdzv-backend"),
    ("rdzv-backend-long", ["--rdzv-backend", LONG, S], "--rdzv-backend"),
    ("static-min-max", ["--rdzv-backend", "static", "--nnodes", "1:2", S], "fixed --nnodes"),
    ("recovery-unknown", ["--recovery", "none", S], ("--recovery", "'none'")),
    ("recovery-non-utf8", ["--recovery", NON_UTF8, S], "--recovery"),
    ("recovery-long", ["--recovery", LONG, S], "--recovery"),
    ("device-gpu", ["--device", "gpu", S], ("--device", "'gpu'")),
    ("device-non-utf8", ["--device", NON_UTF8, S], "--device"),
    ("device-long", ["--device", LONG, S], "--device"),
    ("devices-word", ["--devices", "first", S], "--devices"),
    ("devices-negative", ["--devices", "-1", S], ("--devices", "'-1'")),
    ("devices-empty-item", ["--devices", "0,,1", S], "--devices"),
    ("devices-range", ["--devices", "0-3", S], "--devices"),
    ("devices-superscript", ["--devices", "\u00b2", S], "--devices"),
    ("devices-digits", ["--devices", DIGITS, S], "--devices"),
    ("devices-non-utf8", ["--devices", NON_UTF8, S], "--devices"),
    ("ranks-filter-word", ["--local-ranks-filter", "all", S], "--local-ranks-filter"),
    ("ranks-filter-negative", ["--local-ranks-filter", "0,-1", S], ("--local-ranks-filter", ">= 0")),
    ("ranks-filter-empty-item", ["--local-ranks-filter", "0,,1", S], "--local-ranks-filter"),
    ("ranks-filter-digits", ["--local-ranks-filter", DIGITS, S], "--local-ranks-filter"),
    ("ranks-filter-non-utf8", ["--local-ranks-filter", NON_UTF8, S], "--local-ranks-filter"),
    ("redirects-four", ["-r", "4", S], ("--redirects", "'4'")),
    ("redirects-negative", ["--redirects", "-1", S], "--redirects"),
    ("redirects-empty", ["-r", "", S], "--redirects"),
    ("redirects-rank-without-bits", ["-r", "0:", S], "--redirects"),
    ("redirects-rank-twice", ["-r", "0:1,0:2", S], ("--redirects", "'0:1,0:2'")),
    ("redirects-negative-rank", ["-r", "-1:1", S], ("--redirects", "'-1:1'")),
    ("redirects-long", ["-r", LONG, S], "--redirects"),
    ("tee-word", ["-t", "both", S], ("--tee", "'both'")),
    ("tee-fraction", ["--tee", "1.5", S], "--tee"),
    ("tee-rank-word", ["-t", "x:1", S], "--tee"),
    ("tee-digits", ["-t", DIGITS, S], "--tee"),
    ("tee-non-utf8", ["-t", NON_UTF8, S], "--tee"),
    ("status-unknown", ["--status", "loud", S], ("--status", "'loud'")),
    ("status-non-utf8", ["--status", NON_UTF8, S], "--status"),
    ("status-long", ["--status", LONG, S], "--status"),
    ("master-port-zero", ["--master-port", "0", S], ("--master-port", "0")),
    ("master-port-negative", ["--master-port", "-1", S], "--master-port"),
    ("master-port-above-range", ["--master-port", "65536", S], ("--master-port", "65536")),
    ("master-port-huge", ["--master-port", HUGE, S], "--master-port"),
    ("master-port-word", ["--master-port", "http", S], "--master-port"),
    ("master-addr-empty-label", ["--master-addr", "head..example", S], ("--master-addr", "'head..example'")),
    ("master-addr-long-label", ["--master-addr", LONG_LABEL, S], "--master-addr"),
    ("local-addr-non-utf8", ["--local-addr", NON_UTF8, S], "--local-addr"),
    ("local-addr-long", ["--local-addr", LONG, S], "--local-addr"),
    ("store-bind-long-label", ["--store-bind", LONG_LABEL, S], "--store-bind"),
    ("store-bind-non-utf8", ["--store-bind", NON_UTF8, S], "--store-bind"),
    ("token-file-missing", ["--token-file", "no-such-token", S], ("--token-file", "no-such-token")),
    ("token-file-group-readable", ["--token-file", "{tmp}/token-0640", S], ("--token-file", "0640")),
    ("token-file-world-readable", ["--token-file", "{tmp}/token-0604", S], ("--token-file", "0604")),
    ("token-file-empty", ["--token-file", "{tmp}/token-empty", S], ("--token-file", "holds 0 bytes")),
    ("token-file-blank", ["--token-file", "{tmp}/token-blank", S], ("--token-file", "holds 0 bytes")),
    ("token-file-short", ["--token-file", "{tmp}/token-short", S], ("--token-file", "holds 5 bytes")),
    ("token-file-huge", ["--token-file", "{tmp}/token-huge", S], ("--token-file", "longer than")),
    ("token-file-folder", ["--token-file", "{tmp}", S], "--token-file"),
    ("token-file-non-utf8-name", ["--token-file", NON_UTF8, S], "--token-file"),
    ("fault-levels-folder", ["--fault-levels", "{tmp}", S], "--fault-levels"),
    ("fault-levels-non-utf8-name", ["--fault-levels", NON_UTF8, S], "--fault-levels"),
    ("device-ips-missing", ["--device-ips", "no-such-ips.yaml", S], ("--device-ips", "no-such-ips.yaml")),
    ("device-ips-folder", ["--device-ips", "{tmp}", S], "--device-ips"),
    ("config-folder", ["--config", "{tmp}", S], "cannot read config file"),
    ("config-non-utf8-name", ["--config", NON_UTF8, S], "cannot read config file"),
    ("hostfile-folder", ["--hostfile", "{tmp}", S], "cannot read hostfile"),
    ("hostfile-non-utf8-name", ["--hostfile", NON_UTF8, S], "cannot read hostfile"),
    ("print-hosts-alone", ["--print-hosts"], "--print-hosts needs --hostfile"),
    ("script-non-utf8-name", [NON_UTF8], "training script"),
    ("script-is-a-folder", ["{tmp}"], "training script"),
    ("module-empty-name", ["-m", ""], "no training script"),
    ("no-python-missing-program", ["--no-python", "no-such-program-ftrun"], "--no-python"),
    ("no-python-not-executable", ["--no-python", "{tmp}/train.py"], "--no-python"),
    ("run-path-and-module", ["--run-path", "-m", "pkg"], "cannot be combined"),
    ("start-method-word", ["--start-method", "thread", S], ("--start-method", "thread")),
    ("numa-binding-word", ["--numa-binding", "cpu", S], ("--numa-binding", "cpu")),
    ("numa-binding-empty", ["--numa-binding", "", S], "--numa-binding"),
    ("signals-to-handle-unknown", ["--signals-to-handle", "SIGNOPE", S], ("--signals-to-handle", "SIGNOPE")),
    ("signals-to-handle-sigkill", ["--signals-to-handle", "SIGTERM,SIGKILL", S], ("--signals-to-handle", "SIGKILL")),
    ("signals-to-handle-number", ["--signals-to-handle", "999", S], ("--signals-to-handle", "999")),
    ("signals-to-handle-non-utf8", ["--signals-to-handle", NON_UTF8, S], "--signals-to-handle"),
    ("shutdown-timeout-word", ["--shutdown-timeout", "soon", S], ("--shutdown-timeout", "soon")),
    ("shutdown-timeout-negative", ["--shutdown-timeout", "-1", S], ("timeout", "-1")),
    ("shutdown-timeout-and-stop-timeout-differ", ["--shutdown-timeout", "3", "--stop-timeout", "4", S],
     ("--shutdown-timeout 3", "--stop-timeout 4")),
    ("virtual-local-rank-with-value", ["--virtual-local-rank=yes", S], "--virtual-local-rank"),
    ("worker-port-range-word", ["--worker-port-range", "many", S], ("--worker-port-range", "many")),
    ("worker-port-range-reversed", ["--worker-port-range", "30010-30000", S], ("--worker-port-range", "30010-30000")),
    ("worker-port-range-zero", ["--worker-port-range", "0-10", S], "--worker-port-range"),
    ("worker-port-range-above", ["--worker-port-range", "65530-65536", S], "--worker-port-range"),
    ("worker-port-range-huge", ["--worker-port-range", HUGE, S], "--worker-port-range"),
    ("worker-port-range-open", ["--worker-port-range", "30000-", S], "--worker-port-range"),
    ("worker-port-range-non-utf8", ["--worker-port-range", NON_UTF8, S], "--worker-port-range"),
    ("log-layout-word", ["--log-layout", "deepspeed", S], ("--log-layout", "deepspeed")),
    ("stragglers-word", ["--stragglers", "evict", S], ("--stragglers", "evict")),
    ("metrics-port-above-range", ["--metrics-port", "70000", S], ("--metrics-port", "70000")),
    ("metrics-port-negative", ["--metrics-port", "-1", S], "--metrics-port"),
    ("log-layout-empty-word", ["--log-layout", " ", S], "--log-layout"),
    ("flag-typo", ["--nnode", "2", S], "--nnode"),
    ("flag-without-value", ["--nnodes"], "--nnodes"),
    ("switch-with-value", ["--standalone=yes", S], "--standalone"),
]


@pytest.fixture
def token_files(tmp_path):
    for name, data, mode in [("token-0640", b"t" * 32, 0o640), ("token-0604", b"t" * 32, 0o604),
                             ("token-empty", b"", 0o600), ("token-blank", b" \n\t\n", 0o600),
                             ("token-short", b"short\n", 0o600), ("token-huge", b"t" * 5000, 0o600)]:
        (tmp_path / name).write_bytes(data)
        (tmp_path / name).chmod(mode)


@pytest.mark.parametrize("argv, words", [c[1:] for c in FLAGS], ids=[c[0] for c in FLAGS])
def test_bad_flag(argv, words, tmp_path, capsys, token_files):
    code, stderr = run_main(expand(argv, tmp_path), capsys)
    assert code == USAGE, stderr
    assert_one_clear_line(stderr, words)


# --- flags of a head node (--hostfile): checked before any ssh; --dry-run so nothing would run anyway ---

CLUSTER_FLAGS = [
    ("etcd-hostfile-without-members", ["--rdzv-backend", "etcd"], "needs --rdzv-endpoint"),
    ("etcd-hostfile-rdzv-host", ["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1", "--rdzv-host", "head"],
     "--rdzv-host names where the hosts reach this head node's store"),
    ("ssh-port-negative", ["--ssh-port", "-1"], "--ssh-port"),
    ("ssh-port-above-range", ["--ssh-port", "65536"], ("--ssh-port", "65536")),
    ("ssh-port-huge", ["--ssh-port", HUGE], "--ssh-port"),
    ("ssh-port-word", ["--ssh-port", "ssh"], "--ssh-port"),
    ("ssh-option-empty", ["--ssh-option", ""], "--ssh-option"),
    ("ssh-option-no-name", ["--ssh-option", "=yes"], "--ssh-option"),
    ("ssh-option-non-utf8", ["--ssh-option", f"{NON_UTF8}=1"], "--ssh-option"),
    ("env-empty", ["--env", ""], "--env"),
    ("env-no-name", ["--env", "=1"], "--env"),
    ("env-space-in-name", ["--env", "A B=1"], "--env"),
    ("env-non-utf8-name", ["--env", f"{NON_UTF8}=1"], "--env"),
    ("include-host-twice", ["--include", "n01@n01"], ("--include", "'n01' is named twice")),
    ("include-range-names-twice", ["--include", "n01@n[01-02]"], ("--include", "named twice")),
    ("include-slot-digits", ["--include", f"n01:{DIGITS}"], ("--include", "whole numbers")),
    ("include-non-utf8", ["--include", NON_UTF8], "--include"),
    ("include-empty-host", ["--include", "n01@"], ("--include", "empty host")),
    ("exclude-range-backwards", ["--exclude", "n[02-01]"], ("--exclude", "backwards")),
    ("exclude-range-digits", ["--exclude", f"n[1-{DIGITS}]"], ("--exclude", "bad range")),
    ("endpoint-long-label", ["--rdzv-endpoint", f"{LONG_LABEL}:29400"], "is not a host name"),
    ("endpoint-non-utf8", ["--rdzv-endpoint", f"{NON_UTF8}:29400"], "is not a host name"),
    ("nnodes-word", ["--nnodes", "all"], "--nnodes"),
    ("nnodes-zero", ["--nnodes", "0"], "--nnodes"),
    ("nproc-zero", ["--nproc-per-node", "0"], "--nproc-per-node"),
    ("master-port", ["--master-port", "29501"], "--master-port cannot be used with --hostfile"),
    ("rdzv-backend", ["--rdzv-backend", "static"], "--rdzv-backend static cannot be used with --hostfile"),
    ("token-file-missing", ["--token-file", "no-such-token"], "--token-file"),
]


@pytest.mark.parametrize("args, words", [c[1:] for c in CLUSTER_FLAGS], ids=[c[0] for c in CLUSTER_FLAGS])
def test_bad_flag_of_a_head_node(args, words, tmp_path, capsys):
    (tmp_path / "hosts").write_text("n01 slots=2\nn02 slots=2\n")
    code, stderr = run_main(["--hostfile", "hosts", "--dry-run", *args, str(tmp_path / "train.py")], capsys)
    assert code == USAGE, stderr
    assert_one_clear_line(stderr, words)


# --- hostfile lines (tests/unit/test_hosts.py has the first 23; these are the rest) -------------------

HOSTFILE_LINES = [
    # (id, the line, words of the error after "hostfile h, line 2: ")
    ("slots-huge", f"n1 slots={HUGE}", ("slots", "at most")),
    ("slots-digits", f"n1 slots={DIGITS}", ("slots", "at most")),
    ("horovod-slots-huge", f"n1:{HUGE}", ("slots", "at most")),
    ("slots-leading-zeros-zero", "n1 slots=000", ("slots", "'000'")),
    ("max-slots-below-slots", "n1 slots=4 max_slots=2", "slots=4 above max_slots=2"),
    ("max-slots-before-slots", "n1 max_slots=2 slots=4", "slots=4 above max_slots=2"),
    ("horovod-max-slots-below", "n1:4 max_slots=2", "slots=4 above max_slots=2"),
    ("max-slots-zero", "n1 slots=1 max_slots=0", ("slots", "'0'")),
    ("slots-after-horovod-twice", "n1:2 slots=2", "twice"),
    ("spare-with-value", "n1 spare=yes", "unexpected 'spare=yes'"),
    ("empty-name-with-slots", ":2", "not a host name"),
    ("empty-label", "n1..cluster", "'n1..cluster'"),
    ("label-too-long", f"{LONG_LABEL}.cluster", "not a host name"),
    ("name-10kb", LONG, "not a host name"),
    ("name-non-ascii", "n\u00f6de1", "not a host name"),
    ("name-non-utf8", f"n1{NON_UTF8}", "not a host name"),
    ("name-with-bom", "\ufeffn1", "not a host name"),
    ("user-empty", "@n1 slots=1", "not a host name"),
    ("user-with-shell", "a$(id)@n1", "not a host name"),
    ("quote-in-name", "n1'", "not a host name"),
    ("backslash-in-name", "n1\\", "not a host name"),
    ("glob-in-name", "n*", "not a host name"),
    ("redirect-in-name", "n1>x", "not a host name"),
    ("ampersand-in-name", "n1&", "not a host name"),
    ("slots-with-sign", "n1 slots=+2", ("slots", "'+2'")),
    ("slots-with-space-after-equals", "n1 slots= 2", "slots"),
]


@pytest.mark.parametrize("line, words", [c[1:] for c in HOSTFILE_LINES], ids=[c[0] for c in HOSTFILE_LINES])
def test_bad_hostfile_line_names_the_line(line, words):
    with pytest.raises(UsageError) as caught:
        parse_hostfile(f"# the cluster\n{line}\n", "hostfile h")
    message = caught.value.message
    assert message.startswith("hostfile h, line 2: ") and "\n" not in message
    for word in (words,) if isinstance(words, str) else words:
        assert word in message


DUPLICATE_HOSTS = [
    ("thrice", "n1\n" * 3, "h, line 2: host 'n1' is already listed on line 1"),
    ("two-users-apart", "bob@n1\n10.0.0.1\nalice@n1\n", "h, line 3: host 'n1' is already listed on line 1"),
    ("user-and-horovod", "n1:2\nbob@n1 slots=2\n", "h, line 2: host 'n1' is already listed on line 1"),
]


@pytest.mark.parametrize("text, message", [c[1:] for c in DUPLICATE_HOSTS], ids=[c[0] for c in DUPLICATE_HOSTS])
def test_duplicate_hosts(text, message):
    with pytest.raises(UsageError) as caught:
        parse_hostfile(text, "h")
    assert caught.value.message == message


HOSTFILE_BYTES = [
    ("utf-16", "n1\n".encode("utf-16"), "cannot read hostfile"),
    ("nul", b"n1\x00 slots=2\n", "not a host name"),
    ("slots-huge", b"n1 slots=100001\n", "at most 100000"),
    ("max-slots-below", b"n1 slots=8 max_slots=4\n", "above max_slots=4"),
    ("long-label", LONG_LABEL.encode() + b"\n", "not a host name"),
    ("only-spares", b"n1 spare\nn2 spare\n", "no host to run on: every host left is a spare"),
]


@pytest.mark.parametrize("data, words", [c[1:] for c in HOSTFILE_BYTES], ids=[c[0] for c in HOSTFILE_BYTES])
def test_bad_hostfile_through_the_command_line(data, words, tmp_path, capsys):
    (tmp_path / "hosts").write_bytes(data)
    code, stderr = run_main(["--hostfile", "hosts", "--dry-run", str(tmp_path / "train.py")], capsys)
    assert code == USAGE, stderr
    assert_one_clear_line(stderr, words)


# --- config file: every key with a value of the wrong type ---------------------------------------------

PARAMS = {p.name: p for p in launch_command.params if p.name not in NOT_IN_CONFIG}
SWITCHES = sorted(n for n, p in PARAMS.items() if getattr(p, "is_flag", False))
#: repeatable options take a list or one value, and the script's arguments a list or one string
LISTS = sorted(n for n, p in PARAMS.items() if getattr(p, "multiple", False) or p.nargs == -1)
SINGLE = sorted(set(PARAMS) - set(SWITCHES) - set(LISTS))
#: switches read when the job is built (print_hosts and dry_run act at once; see the report)
CHECKED_SWITCHES = ["module", "no_python", "preflight", "run_path", "standalone", "virtual_local_rank"]
#: keys whose value is a count, a port, a duration, device ids or stream bits: 10**30 is wrong for each
NUMBERS = ["checkpoint_every", "checkpoint_interval", "devices", "device_timeout", "hang_timeout", "health_interval", "heartbeat_timeout",
           "keep_checkpoints", "master_port", "monitor_interval", "nnodes", "node_rank", "node_timeout",
           "nproc_per_node", "online_window", "rdzv_timeout", "redirects", "repair_timeout", "replicate_every",
           "snapshot_every", "snapshot_replicas", "spares", "stop_timeout", "tee", "warm_standby", "metrics_port"]
#: keys where null is not "the default" but a missing value (null elsewhere leaves the default)
NULL_IS_WRONG = ["checkpoint_every", "device_timeout", "hang_timeout", "health_interval", "heartbeat_timeout",
                 "keep_checkpoints", "monitor_interval", "nnodes", "node_rank", "node_timeout", "nproc_per_node",
                 "online_window", "redirects", "repair_timeout", "replicate_every", "snapshot_replicas", "stop_timeout",
                 "tee"]

CONFIG_VALUES = (
    [(f"{key}-list", key, "[1, 2]") for key in SINGLE + SWITCHES if key != "max_restarts"]  # integration has it
    + [(f"{key}-mapping", key, "{a: 1}") for key in SINGLE + SWITCHES + ["script_args"]]
    + [(f"{key}-bool", key, "true") for key in SINGLE]
    + [(f"{key}-word", key, "'no'") for key in CHECKED_SWITCHES]
    + [(f"{key}-number", key, "1") for key in SWITCHES]
    + [(f"{key}-huge", key, HUGE) for key in NUMBERS]
    + [(f"{key}-null", key, "null") for key in NULL_IS_WRONG]
    + [(f"{key}-nested-list", key, "[[a]]") for key in ["script_args"]]
)


def test_the_config_table_covers_every_key():
    keys = {case[1] for case in CONFIG_VALUES}
    assert keys == set(PARAMS) - {"env", "ssh_option"}  # these two take any list (they repeat on the command line)


@pytest.mark.parametrize("key, value", [c[1:] for c in CONFIG_VALUES], ids=[c[0] for c in CONFIG_VALUES])
def test_config_key_of_the_wrong_type(key, value, tmp_path, capsys):
    script = f"script: {tmp_path / 'train.py'}\n" if key != "script" else ""
    (tmp_path / "job.yaml").write_text(f"{script}{key}: {value}\n")
    code, stderr = run_main(["--config", "job.yaml"], capsys)  # the script comes from the file
    assert code == USAGE, stderr
    assert_one_clear_line(stderr, ())
    flag = "--" + key.replace("_", "-")
    assert key in stderr or flag in stderr, stderr


CONFIG_FILES = [
    # (id, the file's bytes or text, words of the error line)
    ("key-twice", "nnodes: 1\nnnodes: 2\n", "line 2: key 'nnodes' is already given on line 1"),
    ("key-thrice", "tee: 1\nrole: a\ntee: 2\ntee: 3\n", "line 3: key 'tee' is already given on line 1"),
    ("key-twice-two-spellings", "nproc-per-node: 2\nnproc_per_node: 3\n",
     "sets 'nproc_per_node' twice (as 'nproc-per-node' and 'nproc_per_node')"),
    ("alias-and-key-differ", "max_restarts: 1\nfault_retry_times: 2\n", "sets max_restarts twice"),
    ("rdzv-id-and-run-id-differ", "run_id: a\nrdzv_id: b\n", "sets run_id twice"),
    ("nested-key-twice", "nnodes: {a: 1, a: 2}\n", "key 'a' is already given"),
    ("scalar", "42\n", "must be a mapping"),
    ("text", "'nnodes: 2'\n", "must be a mapping"),
    ("near-miss-key", "nproc_per_nodes: 2\n", ("unknown key 'nproc_per_nodes'", "did you mean 'nproc_per_node'")),
    ("number-key", "1: 2\n", "unknown key '1'"),
    ("null-key", "~: 2\n", "unknown key 'None'"),
    ("tab-indented", "nnodes:\n\t- 1\n", "not valid YAML at line 2"),
    ("unclosed-quote", "run_id: 'job\n", "not valid YAML"),
    ("python-object", "nnodes: !!python/object/apply:os.system ['true']\n", "not valid YAML"),
    ("number-5000-digits", f"max_restarts: {DIGITS}\n", "not valid YAML"),
    ("nested-600-deep", "a: " + "[" * 600 + "]" * 600 + "\n", "not valid YAML"),
    ("bad-date", "run_id: 2001-13-45\n", "not valid YAML"),
    ("tagged-junk-timestamp", "run_id: !!timestamp junk\n", "not valid YAML"),
    ("tagged-junk-int", "max_restarts: !!int junk\n", "not valid YAML"),
    ("latin-1", "role: n\u00f6de\n".encode("latin-1"), "not UTF-8"),
    ("utf-16", "nnodes: 2\n".encode("utf-16"), "not UTF-8"),
    ("byte-order-mark", "\ufeffnnodes: 0\n", "--nnodes"),
    ("huge-file", "".join(f"key{i}: {i}\n" for i in range(3000)), "unknown key 'key0'"),
    # a script on the command line comes with its own arguments: these name the script in the file
    ("script-args-unclosed-quote", "script: {script}\nscript_args: \"--name 'x\"\n", "script_args"),
    ("script-args-nested", "script: {script}\nscript_args: [--lr, [1, 2]]\n", "script_args"),
    ("script-missing", "script: no_such_train.py\n", "no_such_train.py"),
]


@pytest.mark.parametrize("text, words", [c[1:] for c in CONFIG_FILES], ids=[c[0] for c in CONFIG_FILES])
def test_bad_config_file(text, words, tmp_path, capsys):
    script = tmp_path / "train.py"
    data = text if isinstance(text, bytes) else text.replace("{script}", str(script)).encode()
    (tmp_path / "job.yaml").write_bytes(data)
    in_file = b"script:" in data
    code, stderr = run_main(["--config", "job.yaml", *([] if in_file else [str(script)])], capsys)
    assert code == USAGE, stderr
    assert_one_clear_line(stderr, words)


# --- environment variables ------------------------------------------------------------------------------

SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "0"}
ENVIRONMENT = [
    # (id, variables, arguments before the script, words of the error line)
    ("pet-nnodes-word", {"PET_NNODES": "abc"}, [], ("PET_NNODES", "'abc'")),
    ("pet-nnodes-non-utf8", {"PET_NNODES": NON_UTF8}, [], "PET_NNODES"),
    ("pet-nproc-zero", {"PET_NPROC_PER_NODE": "0"}, [], "PET_NPROC_PER_NODE"),
    ("pet-node-rank-word", {"PET_NODE_RANK": "x"}, [], "PET_NODE_RANK"),
    ("pet-max-restarts-negative", {"PET_MAX_RESTARTS": "-1"}, [], "PET_MAX_RESTARTS"),
    ("pet-fault-retry-times-word", {"PET_FAULT_RETRY_TIMES": "many"}, [], "PET_FAULT_RETRY_TIMES"),
    ("pet-max-restarts-and-flag-alias", {"PET_MAX_RESTARTS": "1"}, ["--fault-retry-times", "2"], "set one option"),
    ("torch-elastic-shutdown-timeout-word", {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, [], "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"),
    ("torch-elastic-shutdown-timeout-and-flag", {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30"}, ["--stop-timeout", "5"],
     "set one option"),
    ("pet-signals-to-handle-unknown", {"PET_SIGNALS_TO_HANDLE": "SIGTERM,NOPE"}, [], ("PET_SIGNALS_TO_HANDLE", "NOPE")),
    ("pet-numa-binding-word", {"PET_NUMA_BINDING": "all"}, [], "PET_NUMA_BINDING"),
    ("pet-worker-port-range-word", {"PET_WORKER_PORT_RANGE": "a-b"}, [], "PET_WORKER_PORT_RANGE"),
    ("pet-start-method-word", {"PET_START_METHOD": "thread"}, [], "PET_START_METHOD"),
    ("pet-monitor-interval-nan", {"PET_MONITOR_INTERVAL": "nan"}, [], "PET_MONITOR_INTERVAL"),
    ("pet-heartbeat-timeout-zero", {"PET_HEARTBEAT_TIMEOUT": "0"}, [], "PET_HEARTBEAT_TIMEOUT"),
    ("pet-rdzv-endpoint-port-zero", {"PET_RDZV_ENDPOINT": "head:0"}, [], "PET_RDZV_ENDPOINT"),
    ("pet-rdzv-conf-no-equals", {"PET_RDZV_CONF": "join_timeout"}, [], "PET_RDZV_CONF"),
    ("pet-rdzv-backend-etcd", {"PET_RDZV_BACKEND": "etcd", "PET_NNODES": "2"}, [], "needs --rdzv-endpoint"),
    ("pet-recovery-unknown", {"PET_RECOVERY": "node"}, [], "PET_RECOVERY"),
    ("pet-device-unknown", {"PET_DEVICE": "tpu"}, [], "PET_DEVICE"),
    ("pet-devices-word", {"PET_DEVICES": "all"}, [], "PET_DEVICES"),
    ("pet-status-unknown", {"PET_STATUS": "loud"}, [], "PET_STATUS"),
    ("pet-spares-negative", {"PET_SPARES": "-1"}, [], "PET_SPARES"),
    ("pet-warm-standby-huge", {"PET_WARM_STANDBY": HUGE}, [], "PET_WARM_STANDBY"),
    ("pet-standalone-word", {"PET_STANDALONE": "maybe"}, [], "PET_STANDALONE"),
    ("pet-redirects-nine", {"PET_REDIRECTS": "9"}, [], "PET_REDIRECTS"),
    ("pet-ranks-filter-negative", {"PET_LOCAL_RANKS_FILTER": "-1"}, [], "PET_LOCAL_RANKS_FILTER"),
    ("pet-token-file-missing", {"PET_TOKEN_FILE": "no-such-token"}, [], "PET_TOKEN_FILE"),
    ("pet-hostfile-missing", {"PET_HOSTFILE": "no-such-hosts"}, [], "cannot read hostfile no-such-hosts"),
    ("ftrun-config-missing", {"FTRUN_CONFIG": "no-such.yaml"}, [], "FTRUN_CONFIG: cannot read config file no-such.yaml"),
    ("ftrun-config-folder", {"FTRUN_CONFIG": "."}, [], "FTRUN_CONFIG: cannot read config file"),
    ("pet-nnodes-elastic-without-endpoint", {"PET_NNODES": "2:4"}, [], ("PET_NNODES 2:4 (elastic) needs --rdzv-endpoint",
                                                                      "static rendezvous")),
    ("slurm-nnodes-word", {**SLURM, "SLURM_NNODES": "abc"}, [], ("SLURM_NNODES", "'abc'")),
    ("slurm-nnodes-digits", {**SLURM, "SLURM_NNODES": DIGITS}, [], "SLURM_NNODES"),
    ("slurm-nnodes-mismatch", {**SLURM, "SLURM_NNODES": "3"}, [], ("SLURM_NNODES is 3", "names 2 nodes")),
    ("slurm-nodeid-negative", {**SLURM, "SLURM_NODEID": "-1"}, [], ("SLURM_NODEID", "'-1'")),
    ("slurm-nodeid-empty", {**SLURM, "SLURM_NODEID": ""}, [], "SLURM_NODEID"),
    ("slurm-nodeid-superscript", {**SLURM, "SLURM_NODEID": "\u00b2"}, [], "SLURM_NODEID"),
    ("slurm-nodeid-out-of-range", {**SLURM, "SLURM_NODEID": "2"}, [], ("SLURM_NODEID 2", "2 nodes")),
    ("slurm-nodelist-backwards", {**SLURM, "SLURM_JOB_NODELIST": "n[3-1]"}, [], ("SLURM_JOB_NODELIST", "backwards")),
    ("slurm-nodelist-unset", {"SLURM_JOB_ID": "4242"}, [], "SLURM_JOB_NODELIST is not set"),
    ("slurm-nodelist-empty", {**SLURM, "SLURM_JOB_NODELIST": ""}, [], "SLURM_JOB_NODELIST is not set"),
    ("slurm-nodelist-unclosed", {**SLURM, "SLURM_JOB_NODELIST": "n[1-2"}, [], "SLURM_JOB_NODELIST"),
    ("slurm-nodelist-range-digits", {**SLURM, "SLURM_JOB_NODELIST": f"n[1-{DIGITS}]"}, [], "bad range"),
    ("slurm-nodelist-range-huge", {**SLURM, "SLURM_JOB_NODELIST": "n[1-999999]"}, [], "too long"),
    ("slurm-nodelist-long-label", {**SLURM, "SLURM_JOB_NODELIST": LONG_LABEL}, [], "SLURM_JOB_NODELIST"),
    ("slurm-nodelist-non-utf8", {**SLURM, "SLURM_JOB_NODELIST": NON_UTF8}, [], "SLURM_JOB_NODELIST"),
    ("slurm-nodelist-shell", {**SLURM, "SLURM_JOB_NODELIST": "n1;reboot"}, [], "SLURM_JOB_NODELIST"),
    ("slurm-ntasks-per-node-two", {**SLURM, "SLURM_NTASKS_PER_NODE": "2"}, [], "--ntasks-per-node=1"),
    ("slurm-tasks-per-node-repeat", {**SLURM, "SLURM_TASKS_PER_NODE": "1,2(x3)"}, [], "2(x3)"),
    ("slurm-tasks-per-node-garbage", {**SLURM, "SLURM_TASKS_PER_NODE": "1(x2),,1"}, [], "SLURM_TASKS_PER_NODE"),
    ("slurm-tasks-per-node-digits", {**SLURM, "SLURM_TASKS_PER_NODE": DIGITS}, [], "SLURM_TASKS_PER_NODE"),
    ("slurm-job-id-non-utf8", {**SLURM, "SLURM_JOB_ID": NON_UTF8}, [], "SLURM_JOB_ID"),
    ("slurm-job-id-space", {**SLURM, "SLURM_JOB_ID": "42 43"}, [], "SLURM_JOB_ID"),
    ("slurm-step-id-non-utf8", {**SLURM, "SLURM_STEP_ID": NON_UTF8}, [], "SLURM_STEP_ID"),
    ("slurm-master-port-word", {**SLURM, "MASTER_PORT": "abc"}, [], ("MASTER_PORT", "'abc'")),
    ("slurm-master-port-zero", {**SLURM, "MASTER_PORT": "0"}, [], "MASTER_PORT"),
    ("slurm-master-port-above-range", {**SLURM, "MASTER_PORT": "70000"}, [], ("MASTER_PORT", "70000")),
    ("slurm-master-port-digits", {**SLURM, "MASTER_PORT": DIGITS}, [], "MASTER_PORT"),
    ("slurm-print-hosts-bad", {**SLURM, "SLURM_NODEID": "x"}, ["--print-hosts"], "SLURM_NODEID"),
]


@pytest.mark.parametrize("env, args, words", [c[1:] for c in ENVIRONMENT], ids=[c[0] for c in ENVIRONMENT])
def test_bad_environment_variable(env, args, words, tmp_path, capsys):
    os.environ.update(env)  # the sandbox fixture puts the environment back
    code, stderr = run_main([*args, str(tmp_path / "train.py")], capsys)
    assert code == USAGE, stderr
    assert_one_clear_line(stderr, words)


# --- ftrun status and ftrun report ------------------------------------------------------------------------

SUBCOMMANDS = [
    ("status-endpoint-empty", ["status", "--rdzv-endpoint", ""], "--rdzv-endpoint is empty"),
    ("status-endpoint-blank", ["status", "--rdzv-endpoint", " "], "--rdzv-endpoint is empty"),
    ("status-endpoint-no-host", ["status", "--rdzv-endpoint", ":29400"], "no host name"),
    ("status-endpoint-port-word", ["status", "--rdzv-endpoint", "head:web"], "port 'web'"),
    ("status-endpoint-port-zero", ["status", "--rdzv-endpoint", "head:0"], "port 0"),
    ("status-endpoint-port-above-range", ["status", "--rdzv-endpoint", "head:99999"], "port 99999"),
    ("status-endpoint-long-label", ["status", "--rdzv-endpoint", f"{LONG_LABEL}:1"], "is not a host name"),
    ("status-endpoint-non-utf8", ["status", "--rdzv-endpoint", f"{NON_UTF8}:1"], "is not a host name"),
    ("status-endpoint-missing", ["status"], "--rdzv-endpoint"),
    ("status-etcd-without-run-id", ["status", "--rdzv-backend", "etcd", "--rdzv-endpoint", "e1"], "needs --run-id"),
    ("status-interval-zero", ["status", "--rdzv-endpoint", "head:1", "--interval", "0"], "--interval"),
    ("status-interval-negative", ["status", "--rdzv-endpoint", "head:1", "--interval", "-1"], "--interval"),
    ("status-interval-inf", ["status", "--rdzv-endpoint", "head:1", "--interval", "inf"], "--interval"),
    ("status-timeout-negative", ["status", "--rdzv-endpoint", "head:1", "--timeout", "-1"], "--timeout"),
    ("status-timeout-word", ["status", "--rdzv-endpoint", "head:1", "--timeout", "soon"], "--timeout"),
    ("status-unknown-flag", ["status", "--rdzv-endpoint", "head:1", "--follow"], "--follow"),
    ("top-endpoint-empty", ["top", "--rdzv-endpoint", ""], "--rdzv-endpoint is empty"),
    ("top-endpoint-port-word", ["top", "--rdzv-endpoint", "head:web"], "port 'web'"),
    ("top-endpoint-missing", ["top"], "--rdzv-endpoint"),
    ("top-token-file-missing", ["top", "--rdzv-endpoint", "head:1", "--token-file", "no-such-token"], "--token-file"),
    ("top-token-file-shared", ["top", "--rdzv-endpoint", "head:1", "--token-file", "shared.token"], "chmod 600"),
    ("top-timeout-word", ["top", "--rdzv-endpoint", "head:1", "--timeout", "soon"], "--timeout"),
    ("top-unknown-flag", ["top", "--rdzv-endpoint", "head:1", "--watch"], "--watch"),
    ("report-no-file", ["report"], "EVENTS.jsonl"),
    ("report-missing", ["report", "no-such.jsonl"], "cannot read no-such.jsonl"),
    ("report-folder", ["report", "."], "cannot read ."),
    ("report-empty", ["report", "empty.jsonl"], "holds no events"),
    ("report-blank-lines", ["report", "blank.jsonl"], "holds no events"),
    ("report-not-json", ["report", "text.jsonl"], "line 1 is not JSON"),
    ("report-not-utf8", ["report", "bytes.jsonl"], "line 1 is not JSON"),
    ("report-json-list", ["report", "list.jsonl"], "line 1 is not an ftrun event"),
    ("report-json-text", ["report", "string.jsonl"], "line 1 is not an ftrun event"),
    ("report-object-without-kind", ["report", "nokind.jsonl"], "line 1 is not an ftrun event"),
    ("report-garbage-second-line", ["report", "second.jsonl"], "line 2 is not JSON"),
    ("report-non-utf8-name", ["report", NON_UTF8], "cannot read"),
]
EVENT_FILES = {
    "empty.jsonl": b"", "blank.jsonl": b"\n \n\t\n", "text.jsonl": b"job started\n", "bytes.jsonl": b"\xff\xfe{}\n",
    "list.jsonl": b"[1, 2]\n", "string.jsonl": b'"job"\n', "nokind.jsonl": b'{"t": 1}\n',
    "second.jsonl": (b'{"t": 0, "elapsed": 0, "source": "controller", "kind": "job_started", "generation": 0, '
                     b'"node": null, "rank": null, "host": null, "detail": ""}\n{oops\n{"kind": "job_finished"}\n'),
}


@pytest.mark.parametrize("argv, words", [c[1:] for c in SUBCOMMANDS], ids=[c[0] for c in SUBCOMMANDS])
def test_bad_input_to_status_or_report(argv, words, tmp_path, capsys):
    for name, data in EVENT_FILES.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "shared.token").write_text("a-token-that-others-can-read\n")
    (tmp_path / "shared.token").chmod(0o644)
    code, stderr = run_main(argv, capsys)
    assert code == USAGE, stderr
    assert_one_clear_line(stderr, words)


def test_top_in_an_install_that_lost_textual_says_how_to_install_it(capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "textual" or m.startswith("textual.")] + ["textual"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    monkeypatch.delitem(sys.modules, "ftrun.top_view.app", raising=False)
    code, stderr = run_main(["top", "--rdzv-endpoint", "127.0.0.1:1"], capsys)
    assert code == USAGE
    assert_one_clear_line(stderr, "pip install 'textual>=8.0'")


def test_top_of_a_refused_port_or_a_store_without_a_job(capsys):
    from ftrun.config import Endpoint
    from ftrun.store import host_store

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, stderr = run_main(["top", "--rdzv-endpoint", f"127.0.0.1:{port}"], capsys)
    assert code == ExitCode.RENDEZVOUS
    assert_one_clear_line(stderr, ("cannot reach the store", "Connection refused"))
    store = host_store(Endpoint("127.0.0.1", port))  # a store, but no job on it
    try:
        code, stderr = run_main(["top", "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "5"], capsys)
    finally:
        del store
    assert code == ExitCode.RENDEZVOUS
    assert_one_clear_line(stderr, "no ftrun job has started")


PROBE = [
    ("timeout-zero", ["--device-timeout", "0"], "--device-timeout"),
    ("timeout-nan", ["--device-timeout", "nan"], "--device-timeout"),
    ("timeout-huge", ["--device-timeout", "1e300"], ("--device-timeout", "at most")),
    ("device-non-utf8", ["--device", NON_UTF8], "--device"),
    ("fault-levels-folder", ["--fault-levels", "."], "--fault-levels"),
    ("json-with-value", ["--json=yes"], "--json"),
    ("nodes-without-endpoint", ["--nnodes", "2"], ("--nnodes 2", "--rdzv-endpoint")),
    ("nodes-not-a-number", ["--nnodes", "two"], "--nnodes"),
    ("nodes-zero", ["--nnodes", "0"], "--nnodes"),
    ("nodes-endpoint-bad-port", ["--nnodes", "2", "--rdzv-endpoint", "h:port"], "--rdzv-endpoint"),
    ("nodes-timeout-nan", ["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-timeout", "nan"], "--rdzv-timeout"),
    ("rdzv-conf-not-key-value", ["--rdzv-conf", "is_host"], ("--rdzv-conf", "key=value")),
    ("rdzv-conf-unknown-key", ["--rdzv-conf", "is_hots=1"], "is_hots"),
]


@pytest.mark.parametrize("args, words", [c[1:] for c in PROBE], ids=[c[0] for c in PROBE])
def test_bad_input_to_probe(args, words, capsys):
    code, stderr = run_main(["probe", *args], capsys)
    assert code == USAGE, stderr
    assert_one_clear_line(stderr, words)


def test_store_bind_to_an_address_of_another_machine():
    from ftrun.config import Endpoint
    from ftrun.store import host_store

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(UsageError) as caught:
        host_store(Endpoint("127.0.0.1", port), bind="192.0.2.1")  # TEST-NET-1: never this machine's
    assert caught.value.message.startswith(f"cannot host the store on 192.0.2.1:{port}: ")


DEVICE_IP_FILES = [
    ("list", "- 10.0.0.1\n", "must be a mapping"),
    ("host-to-list", "n1: [10.0.0.1]\n", "host 'n1'"),
    ("device-id-word", "n1: {first: 10.0.0.1}\n", "host 'n1'"),
    ("device-id-negative", "n1: {-1: 10.0.0.1}\n", "host 'n1'"),
    ("address-number", "n1: {0: 42}\n", "host 'n1'"),
    ("host-twice", "n1: {0: 10.0.0.1}\nn1: {0: 10.0.0.2}\n", "key 'n1' is already given on line 1"),
    ("device-twice", "n1: {0: 10.0.0.1, 0: 10.0.0.2}\n", "key '0' is already given"),
    ("not-utf8", b"n1: {0: \xff}\n", "not UTF-8"),
]


@pytest.mark.parametrize("text, words", [c[1:] for c in DEVICE_IP_FILES], ids=[c[0] for c in DEVICE_IP_FILES])
def test_bad_device_ip_file(text, words, tmp_path):
    from ftrun.ranktable import load_device_ips

    path = tmp_path / "ips.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UsageError) as caught:
        load_device_ips(str(path))
    assert words in caught.value.message and str(path) in caught.value.message


# --- npu-smi output: DeviceToolError (one line) or a result of the right type; nothing else ----------------

PARSERS = {
    # parser: (a fixture of real output, the type of what it returns)
    npu_smi.parse_info_table: ("info_a3.txt", list),
    npu_smi.parse_health: ("health_alarm_codes.txt", npu_smi.ChipHealth),
    npu_smi.parse_npu_health: ("health_npu.txt", list),
    npu_smi.parse_list: ("list_old.txt", list),
    npu_smi.parse_mapping: ("mapping_a3_mcu.txt", dict),
    npu_smi.parse_hccn_ip: ("hccn_ip.txt", str),
}
MUTATIONS = {
    "empty": lambda text: "",
    "blank": lambda text: " \n\t\n",
    "garbage": lambda text: "lorem ipsum | dolor : sit\n" * 3,
    "first-half": lambda text: text[: len(text) // 2],
    "first-line": lambda text: text.splitlines()[0],
    "last-line": lambda text: text.splitlines()[-1],
    "one-line": lambda text: text.replace("\n", " "),
    "cut-mid-line": lambda text: text[: text.find("\n", len(text) // 2) - 3],
    "not-utf8": lambda text: (text.encode()[:40] + b"\xff\xfe\x80" + text.encode()[40:]).decode("utf-8", "replace"),
    "surrogates": lambda text: os.fsdecode(text.encode() + b"\xff\xfe"),
    "nul-bytes": lambda text: text.replace("\n", "\x00"),
    "digits-5000": lambda text: text.replace("0", DIGITS),
    "superscripts": lambda text: text.translate(str.maketrans("0123", "\u2070\u00b9\u00b2\u00b3")),
    "huge": lambda text: text * 2000,
    "one-megabyte-line": lambda text: "9" * 1_000_000,
    "refused": lambda text: text + "Invalid card id.\n",
}
NPU_CASES = [(f"{parser.__name__}-{name}", parser, name) for parser in PARSERS for name in MUTATIONS]


@pytest.mark.parametrize("parser, mutation", [c[1:] for c in NPU_CASES], ids=[c[0] for c in NPU_CASES])
def test_npu_smi_output(parser, mutation):
    fixture, kind = PARSERS[parser]
    text = MUTATIONS[mutation]((FIXTURES / fixture).read_text())
    try:
        result = parser(text)
    except DeviceToolError as e:
        assert "\n" not in str(e), str(e)[:200]
        return
    assert isinstance(result, kind)
    assert mutation not in ("empty", "blank", "garbage", "one-megabyte-line", "refused")


# --- values that look wrong but have a sensible meaning: pinned, so that a change is a decision ------------

def _config(**raw):
    from ftrun.config import build_launch_config

    return build_launch_config({"script": "train.py", **raw}, check_script=False)


ACCEPTED = [
    ("devices-repeated", lambda: _config(devices="2,0,2").devices, (0, 2)),
    ("ranks-filter-repeated", lambda: _config(local_ranks_filter="1,1").local_ranks_filter, frozenset({1})),
    ("max-restarts-huge", lambda: _config(max_restarts=HUGE).max_restarts, 10**30),
    ("recovery-upper-case", lambda: _config(recovery="PROCESS").recovery, "process"),
    ("recovery-empty-is-default", lambda: _config(recovery="").recovery, "job"),
    ("recovery-null-is-default", lambda: _config(recovery=None).recovery, "job"),
    ("rdzv-endpoint-empty-is-default", lambda: str(_config(rdzv_endpoint="").endpoint), "127.0.0.1:29500"),
    ("stop-timeout-zero", lambda: _config(stop_timeout="0").stop_timeout, 0.0),
    ("hang-timeout-zero-is-off", lambda: _config(hang_timeout=0).hang_timeout, 0.0),
    ("endpoint-ipv6", lambda: str(_config(rdzv_endpoint="[::1]:29400").endpoint), "::1:29400"),
    ("env-repeated-last-wins", lambda: forwarded_env({}, ["A=1", "A=2"]), (("A", "2"),)),
    ("include-slot-repeated", lambda: parse_host_filter("n1:1,1", "--include"), {"n1": (1,)}),
    # to DNS n1 and N1 are one host, to ssh two aliases: both kept
    ("hosts-differing-in-case", lambda: [h.name for h in parse_hostfile("n1\nN1\n", "h")], ["n1", "N1"]),
    # under process level, the warm interpreter on; at job level, fresh interpreters as under torchrun
    ("config-null-key-is-default",
     lambda: _config(warm_standby=None, recovery="process", nproc_per_node=3).warm_standby, 1),
    ("config-null-key-is-default-at-job-level", lambda: _config(warm_standby=None, recovery="job").warm_standby, 0),
    ("snapshot-memory-units", lambda: [_config(snapshot_every=1, snapshot_memory=v).snapshots.memory
                                       for v in ("1k", "1KiB", "1 kb", "1.5K", "1024")],
     [1024, 1024, 1024, 1536, 1024]),
    ("snapshot-memory-default-half-free", lambda: _config(snapshot_every=1).snapshots.memory > 0, True),
    # the free shared memory is only checked when there are snapshots to keep in it
    ("no-snapshots-no-memory-check", lambda: _config(snapshot_memory="900T").snapshots.memory, 900 * 2**40),
]


@pytest.mark.parametrize("value, expected", [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_odd_but_accepted(value, expected):
    assert value() == expected


def test_an_empty_config_file_sets_nothing(tmp_path):
    from ftrun.config import read_config_file

    for text in ("", "\n", "# nothing yet\n", "---\n"):
        (tmp_path / "job.yaml").write_text(text)
        assert read_config_file(str(tmp_path / "job.yaml")) == {}


# --- bugs this matrix found outside the parsers, fixed: a log level, nan seconds, a foreign event log, a
# --- newline in a value, bytes that are not UTF-8 in --dry-run -------------------------------------------

def test_bad_log_level(tmp_path, capsys):
    os.environ["FTRUN_LOG_LEVEL"] = "LOUD"
    code, stderr = run_main(["--nnodes", "0", str(tmp_path / "train.py")], capsys)
    assert code == USAGE
    assert_one_clear_line(stderr, "FTRUN_LOG_LEVEL")


def test_status_timeout_nan(capsys):
    code, stderr = run_main(["status", "--rdzv-endpoint", "127.0.0.1:1", "--timeout", "nan"], capsys)
    assert code == USAGE
    assert_one_clear_line(stderr, "--timeout")


def test_report_of_an_event_without_its_fields(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text('{"kind": "job_started"}\n')
    code, stderr = run_main(["report", "events.jsonl"], capsys)
    assert code == USAGE
    assert_one_clear_line(stderr, "events.jsonl")


def test_a_value_with_a_newline_still_gets_one_line(tmp_path, capsys):
    code, stderr = run_main(["--recovery", "job\nprocess", str(tmp_path / "train.py")], capsys)
    assert code == USAGE
    assert_one_clear_line(stderr, "--recovery")


def test_dry_run_of_a_value_that_is_not_utf8(tmp_path, capsys, monkeypatch):
    (tmp_path / "hosts").write_text("n01\n")
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")  # any UTF-8 locale's stdout
    monkeypatch.setattr(sys, "stdout", stdout)
    code, _ = run_main(["--hostfile", "hosts", "--dry-run", "--env", f"A={NON_UTF8}", str(tmp_path / "train.py")],
                       capsys)
    assert code == 0
    assert os.fsencode(NON_UTF8) in stdout.buffer.getvalue()  # the same bytes the ssh command would carry


# --- the cases that tests/integration/test_bad_input.py ran each in a process of its own --------------------
# In-process since issue 48: each cost an interpreter's start (about 2 s on 2 cores, 56 of them) and needs no
# process of its own; that file still runs the first case of each table as ``python -m ftrun``, and as before
# the cases whose error comes from a started agent (an endpoint, etcd, a fault table), which here would launch.
# Their assertions as they were there: the exit code, one "ftrun: error:" line among the lines, with the words,
# no traceback.

SCRIPT = str(Path(__file__).resolve().parent.parent / "workers" / "train.py")

CASES = [
    # (id, args, exit code, words the line must contain)
    ("nnodes-zero", ["--nnodes", "0", SCRIPT], 2, "--nnodes"),
    ("nnodes-garbage", ["--nnodes", "a:b", SCRIPT], 2, "--nnodes"),
    ("nnodes-min-above-max", ["--nnodes", "3:2", SCRIPT], 2, "--nnodes"),
    ("nproc-zero", ["--nproc-per-node", "0", SCRIPT], 2, "--nproc-per-node"),
    ("nproc-word", ["--nproc_per_node", "many", SCRIPT], 2, "--nproc-per-node"),
    ("missing-script", ["no_such_train.py"], 2, "no_such_train.py"),
    ("no-script", [], 2, "no training script"),
    ("config-missing", ["--config", "missing.yaml", SCRIPT], 2, "missing.yaml"),
    ("recovery-unknown", ["--recovery", "node", SCRIPT], 2, "--recovery"),
    ("negative-budget", ["--max-restarts", "-1", SCRIPT], 2, "--max-restarts"),
    ("budget-not-a-number", ["--fault-retry-times", "lots", SCRIPT], 2, "lots"),
    ("endpoint-port-word", ["--rdzv-endpoint", "head:http", SCRIPT], 2, "port 'http'"),
    ("endpoint-port-range", ["--rdzv-endpoint", "head:70000", SCRIPT], 2, "70000"),
    ("unknown-flag", ["--frobnicate", SCRIPT], 2, "--frobnicate"),
    ("static-without-node-rank", ["--nnodes", "2", SCRIPT], 2, "--node-rank"),
    ("node-rank-out-of-range", ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "localhost:1", SCRIPT], 2, "--node-rank 2"),
    ("standalone-multi-node", ["--standalone", "--nnodes", "2", SCRIPT], 2, "--standalone"),
    ("module-and-no-python", ["-m", "--no-python", "pkg"], 2, "cannot be combined"),
    ("bad-redirects", ["-r", "7", SCRIPT], 2, "--redirects"),
    ("bad-rdzv-conf", ["--rdzv-conf", "join_timeout", SCRIPT], 2, "--rdzv-conf"),
    ("negative-interval", ["--monitor-interval", "-1", SCRIPT], 2, "--monitor-interval"),
    ("device-unknown", ["--device", "tpu", SCRIPT], 2, "--device must be one of auto, npu, cuda, cpu"),
    ("health-interval-zero", ["--health-interval", "0", SCRIPT], 2, "--health-interval"),
    ("device-timeout-word", ["--device-timeout", "soon", SCRIPT], 2, "--device-timeout"),
    ("hang-timeout-negative", ["--hang-timeout", "-3", SCRIPT], 2, "--hang-timeout"),
    ("fault-levels-missing", ["--fault-levels", "no-such-levels.yaml", SCRIPT], 2, "no-such-levels.yaml"),
    ("probe-device-unknown", ["probe", "--device", "tpu"], 2, "--device must be one of"),
    ("probe-unknown-flag", ["doctor", "--frobnicate"], 2, "--frobnicate"),
]


def assert_one_error_line(stderr: str, words: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ftrun: error:")]
    assert len(errors) == 1, stderr
    assert words in errors[0], stderr
    assert "Traceback" not in stderr


def run_ftrun(argv: list[str], capsys) -> tuple[int, str, str]:
    """``run_main`` with stdout too."""
    sys.stderr.reconfigure(errors="backslashreplace")
    with pytest.raises(SystemExit) as leaving:
        main(argv)
    code = leaving.value.code
    captured = capsys.readouterr()
    return (0 if code is None else code), captured.out, captured.err


@pytest.mark.parametrize("args, code, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_one_clear_line(args, code, words, capsys):
    returncode, _, stderr = run_ftrun(args, capsys)
    assert returncode == code, stderr
    assert_one_error_line(stderr, words)


CONFIGS = [
    ("unknown-key", "nproc_per_node: 2\nnprocs: 4\n", "unknown key 'nprocs'"),
    ("not-yaml", "nnodes: [1, 2\n", "not valid YAML"),
    ("not-a-mapping", "- 1\n- 2\n", "must be a mapping"),
    ("not-utf8", b"nnodes: \xff\xfe\n", "not UTF-8"),
    ("wrong-type", "max_restarts: [1, 2]\n", "--max-restarts"),
]


@pytest.mark.parametrize("text, words", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_bad_config_file_gets_one_clear_line(tmp_path, text, words, capsys):
    path = tmp_path / "job.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    returncode, _, stderr = run_ftrun(["--config", str(path), SCRIPT], capsys)
    assert returncode == 2, stderr
    assert_one_error_line(stderr, words)


HOSTFILES = [
    # (id, hostfile text, extra args, words the line must contain); every one exits 2 before any ssh runs
    ("missing-file", None, [], "cannot read hostfile hosts"),
    ("empty", "# nothing\n\n", [], "lists no hosts"),
    ("slots-zero", "n01 slots=0\n", [], "line 1: slots must be a whole number of at least 1, got '0'"),
    ("slots-word", "n01:many\n", [], "got 'many'"),
    ("duplicate", "n01\nn02\nn01 slots=2\n", [], "line 3: host 'n01' is already listed on line 1"),
    ("unknown-word", "n01 gpus=8\n", [], "unexpected 'gpus=8'"),
    ("option-as-host", "-oProxyCommand=x\n", [], "is not a host name"),
    ("shell-in-host", "n01;reboot\n", [], "is not a host name"),
    ("not-utf8", b"n01 slots=\xff\n", [], "cannot read hostfile hosts"),
    ("include-unknown", "n01\nn02\n", ["--include", "n09"], "--include: host 'n09' is not in the hostfile"),
    ("include-and-exclude", "n01\nn02\n", ["--include", "n01", "--exclude", "n02"], "cannot be combined"),
    ("exclude-everything", "n01\n", ["--exclude", "n01"], "--exclude leaves no host"),
    ("slot-not-there", "n01 slots=2\n", ["--include", "n01:5"], "host 'n01' has no slot 5"),
    ("too-many-nodes", "n01\nn02\n", ["--nnodes", "3"], "--nnodes 3 but the hostfile has 2 hosts"),
    ("with-node-rank", "n01\n", ["--node-rank", "0"], "--node-rank cannot be used with --hostfile"),
    ("with-standalone", "n01\n", ["--standalone"], "--standalone cannot be used with --hostfile"),
    ("bad-env", "n01\n", ["--env", "1X=2"], "--env: '1X=2' is not NAME or NAME=VALUE"),
    ("env-unset", "n01\n", ["--env", "FTRUN_NO_SUCH_VARIABLE"], "FTRUN_NO_SUCH_VARIABLE is not set here"),
    ("bad-ssh-option", "n01\n", ["--ssh-option", "-v"], "--ssh-option must be Name=Value"),
    ("bad-ssh-port", "n01\n", ["--ssh-port", "0"], "--ssh-port must be a port number"),
    ("endpoint-elsewhere", "n01\n", ["--rdzv-endpoint", "192.0.2.1:29400"], "must name it"),
    ("spares-flag", "n01\nn02 spare\n", ["--spares", "1"], "--spares cannot be used with --hostfile"),
    ("bad-devices", "n01\n", ["--devices", "0,x"], "--devices must be device ids"),
]


@pytest.mark.parametrize("text, args, words", [c[1:] for c in HOSTFILES], ids=[c[0] for c in HOSTFILES])
def test_bad_hostfile_or_cluster_flag_gets_one_clear_line(tmp_path, text, args, words, capsys):
    if text is not None:
        (tmp_path / "hosts").write_bytes(text if isinstance(text, bytes) else text.encode())
    returncode, stdout, stderr = run_ftrun(["--hostfile", "hosts", *args, SCRIPT], capsys)
    assert returncode == 2, stderr
    assert_one_error_line(stderr, words)
    assert not stdout
