"""Property tests of the parsers of user input: any text gets the parser's own error or a value, never
another exception; and what a well-formed value says, the parser reads back."""

from __future__ import annotations

import os
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ftrun.auth import Forged, Signer
from ftrun.config import (
    MAX_COUNT,
    MAX_SECONDS,
    RDZV_CONF_KEYS,
    Endpoint,
    StreamSpec,
    _ConfigLoader,
    check_address,
    parse_device_list,
    parse_endpoint,
    parse_nnodes,
    parse_nproc,
    parse_rank_filter,
    parse_rdzv_conf,
    parse_script_args,
    parse_streams,
    parse_yaml_mapping,
    positive_seconds,
    whole_number,
)
from ftrun.devices import DeviceToolError, npu_smi
from ftrun.errors import UsageError
from ftrun.head.hosts import (
    Host,
    expand_nodelist,
    parse_host_filter,
    parse_hostfile,
    select_hosts,
)
from ftrun.head.slurm import slurm_plan

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: the round trips build well-formed values, which take longer to draw and show less per example
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: the characters these parsers split on, so that generated text reaches past their first checks
PUNCTUATION = ":,=@[]-. #\n\t0123456789"
#: arbitrary text: any code point, text from bytes that are not UTF-8 (surrogateescape, as argv and
#: the environment decode), and text dense in the parsers' own separators
TEXT = st.one_of(
    st.text(),
    st.binary().map(os.fsdecode),
    st.text(alphabet=PUNCTUATION + "abnxslotsmax_spare", max_size=40),
)


def fails_cleanly(parse, text, error=UsageError):
    """``parse(text)``, or None when it raised ``error``; anything else escapes and fails the test."""
    try:
        return parse(text)
    except error:
        return None


# --- any text: the parser's own error or a value ------------------------------------------------------------

@FAST
@given(TEXT)
def test_nnodes(text):
    result = fails_cleanly(parse_nnodes, text)
    assert result is None or 1 <= result[0] <= result[1] <= MAX_COUNT


@FAST
@given(TEXT)
def test_nproc(text):
    assume(text.strip() not in ("auto", "cpu", "gpu"))  # these count the devices here
    result = fails_cleanly(parse_nproc, text)
    assert result is None or 1 <= result <= MAX_COUNT


@FAST
@given(TEXT, st.integers(1, 65535))
def test_endpoint(text, default_port):
    result = fails_cleanly(lambda t: parse_endpoint(t, default_port), text)
    assert result is None or (result.host and 0 < result.port < 65536)


@FAST
@given(TEXT)
def test_rdzv_conf(text):
    result = fails_cleanly(parse_rdzv_conf, text)
    assert result is None or set(result) <= set(RDZV_CONF_KEYS)


@FAST
@given(TEXT)
def test_streams(text):
    result = fails_cleanly(lambda t: parse_streams(t, "--tee"), text)
    if result is not None:
        assert 0 <= result.default <= 3 and all(r >= 0 and 0 <= bits <= 3 for r, bits in result.per_rank)
        assert len({r for r, _ in result.per_rank}) == len(result.per_rank)


@FAST
@given(TEXT)
def test_rank_filter(text):
    result = fails_cleanly(parse_rank_filter, text)
    assert result is None or all(r >= 0 for r in result)


@FAST
@given(TEXT)
def test_device_list(text):
    result = fails_cleanly(parse_device_list, text)
    assert result is None or list(result) == sorted(set(result))


@FAST
@given(st.one_of(TEXT, st.floats(), st.integers(), st.booleans(), st.none(), st.lists(st.integers(), max_size=2)))
def test_seconds(value):
    result = fails_cleanly(lambda v: positive_seconds(v, "--stop-timeout", allow_zero=True), value)
    assert result is None or 0 <= result <= MAX_SECONDS


@FAST
@given(st.one_of(TEXT, st.integers(), st.booleans(), st.none(), st.floats()))
def test_whole_number(value):
    result = fails_cleanly(lambda v: whole_number(v, "--spares", 0, MAX_COUNT), value)
    assert result is None or 0 <= result <= MAX_COUNT


@FAST
@given(st.one_of(TEXT, st.lists(st.one_of(TEXT, st.integers(), st.none()), max_size=3)))
def test_script_args(value):
    result = fails_cleanly(parse_script_args, value)
    assert result is None or all(isinstance(arg, str) for arg in result)


@FAST
@given(TEXT)
def test_address(text):
    assert fails_cleanly(lambda t: check_address(t, "--master-addr"), text) in (None, text)


@FAST
@given(st.one_of(TEXT, st.text(alphabet=PUNCTUATION + "abc:{}[]'\"!&*|>-?", max_size=60)))
def test_config_file_text(text):
    result = fails_cleanly(lambda t: parse_yaml_mapping(t, _ConfigLoader, "config file c", "a mapping"), text)
    assert result is None or isinstance(result, dict)


@FAST
@given(TEXT)
def test_hostfile(text):
    hosts = fails_cleanly(lambda t: parse_hostfile(t, "hostfile h"), text)
    if hosts is not None:
        assert hosts and len({h.address for h in hosts}) == len(hosts)
        assert all(not h.name.startswith("-") and (h.devices is None or h.devices) for h in hosts)


@FAST
@given(TEXT)
def test_host_filter(text):
    result = fails_cleanly(lambda t: parse_host_filter(t, "--include"), text)
    assert result is None or all(slots is None or list(slots) == sorted(set(slots)) for slots in result.values())


@FAST
@given(TEXT, st.sampled_from(["include", "exclude"]))
def test_select_hosts(text, which):
    hosts = [Host("n1", (0, 1)), Host("alice@n2"), Host("n3", (0,), spare=True)]
    result = fails_cleanly(lambda t: select_hosts(hosts, **{which: t}), text)
    assert result is None or {h.address for h in result} <= {"n1", "n2", "n3"}


@FAST
@given(TEXT)
def test_nodelist(text):
    names = fails_cleanly(expand_nodelist, text)
    assert names is None or (names and all(names))


SLURM_VARIABLES = ["SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NODEID",
                   "SLURM_TASKS_PER_NODE", "MASTER_PORT"]


@FAST
@given(st.dictionaries(st.sampled_from(SLURM_VARIABLES), TEXT, min_size=1))
def test_slurm_environment(env):
    plan = fails_cleanly(slurm_plan, env)
    if plan is not None:
        assert 0 <= plan.node_rank < len(plan.hosts) and 0 < plan.endpoint.port < 65536


NPU_PARSERS = [npu_smi.parse_info_table, npu_smi.parse_health, npu_smi.parse_npu_health, npu_smi.parse_list,
               npu_smi.parse_mapping, npu_smi.parse_hccn_ip]
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "npu_smi"
#: every line of every real npu-smi and hccn_tool layout in the fixtures
REAL_LINES = sorted({line for path in FIXTURES.iterdir() for line in path.read_text().splitlines()})


@pytest.mark.parametrize("parser", NPU_PARSERS, ids=lambda p: p.__name__)
@FAST
@given(lines=st.lists(st.one_of(st.sampled_from(REAL_LINES), TEXT,
                                st.sampled_from(REAL_LINES).map(lambda line: line[: len(line) // 2])), max_size=30))
def test_npu_smi_output_shuffled_from_real_lines(parser, lines):
    """Real lines of every layout, cut, reordered and mixed with noise (tests/unit/test_npu_smi.py has
    the plain-noise version)."""
    try:
        parser("\n".join(lines))
    except DeviceToolError as e:
        assert "\n" not in str(e)


@FAST
@given(st.binary(), TEXT)
def test_signer_says_forged_of_any_bytes(raw, key):
    with pytest.raises(Forged):
        Signer(b"k" * 32).open(key, raw)


@FAST
@given(st.text(alphabet=PUNCTUATION + '{}"\\:macbody[]', max_size=80))
def test_signer_says_forged_of_json_like_text(text):
    with pytest.raises(Forged):
        Signer(b"k" * 32).open("key", text)


# --- round trips and invariants ---------------------------------------------------------------------------

@FEW
@given(st.integers(1, MAX_COUNT), st.integers(0, MAX_COUNT))
def test_nnodes_reads_back_min_and_max(low, extra):
    high = min(low + extra, MAX_COUNT)
    assert parse_nnodes(f"{low}:{high}") == (low, high)
    assert parse_nnodes(str(low)) == (low, low)
    with pytest.raises(UsageError):
        parse_nnodes(f"{high + 1}:{low}")


LABEL = st.text(alphabet=string.ascii_lowercase + string.digits, min_size=1, max_size=10)
HOST_NAME = st.builds(lambda first, rest, domain: first + rest + "".join("." + d for d in domain),
                      st.sampled_from(string.ascii_lowercase), st.text(alphabet=string.ascii_lowercase + "0123-", max_size=12),
                      st.lists(LABEL, max_size=2))


@FEW
@given(st.one_of(HOST_NAME, st.ip_addresses(v=4).map(str)), st.integers(1, 65535))
def test_endpoint_reads_back_host_and_port(host, port):
    assert parse_endpoint(f"{host}:{port}", 1) == Endpoint(host, port)
    assert parse_endpoint(host, port) == Endpoint(host, port)


@FEW
@given(st.ip_addresses(v=6).map(str), st.integers(1, 65535))
def test_endpoint_reads_back_ipv6_in_brackets(host, port):
    assert parse_endpoint(f"[{host}]:{port}", 1) == Endpoint(host, port)


@FEW
@given(st.dictionaries(st.integers(0, 512), st.integers(0, 3), min_size=1))
def test_streams_read_back_per_rank(bits):
    spec = parse_streams(",".join(f"{rank}:{b}" for rank, b in bits.items()), "-r")
    assert all(spec.for_rank(rank) == b for rank, b in bits.items())
    assert spec.default == 0


@FEW
@given(st.integers(0, 3))
def test_streams_read_back_one_value_for_every_rank(bits):
    assert parse_streams(str(bits), "-t") == StreamSpec(default=bits)


@FEW
@given(st.lists(st.integers(0, 10**6), min_size=1))
def test_rank_filter_and_device_list_read_back(numbers):
    text = ",".join(map(str, numbers))
    assert parse_rank_filter(text) == frozenset(numbers)
    assert parse_device_list(text) == tuple(sorted(set(numbers)))


@FEW
@given(st.dictionaries(st.sampled_from(RDZV_CONF_KEYS), st.text(alphabet=string.ascii_letters + string.digits)))
def test_rdzv_conf_reads_back(conf):
    assert parse_rdzv_conf(",".join(f"{k}={v}" for k, v in conf.items())) == conf


@FEW
@given(st.text(alphabet=string.ascii_lowercase + "-", min_size=1, max_size=6), st.sets(st.integers(0, 5000), min_size=1, max_size=40),
       st.integers(0, 4))
def test_nodelist_of_a_set_of_numbers_expands_back_to_it(prefix, numbers, width):
    names = sorted(f"{prefix}{n:0{width}d}" for n in numbers)
    ordered = sorted(numbers)
    ranges, start = [], ordered[0]  # compress runs into ranges, as Slurm does
    for previous, current in zip(ordered, [*ordered[1:], None]):
        if current != previous + 1:
            ranges.append(f"{start:0{width}d}" if start == previous else f"{start:0{width}d}-{previous:0{width}d}")
            start = current
    expanded = expand_nodelist(f"{prefix}[{','.join(ranges)}]")
    assert sorted(expanded) == names and len(expanded) == len(names)


@FEW
@given(st.lists(HOST_NAME, min_size=1, max_size=8, unique=True))
def test_nodelist_of_plain_names_is_those_names(names):
    assert expand_nodelist(",".join(names)) == names


@FEW
@given(st.lists(st.tuples(HOST_NAME, st.one_of(st.none(), st.integers(1, 64)), st.booleans()),
                min_size=1, max_size=8, unique_by=lambda h: h[0]),
       st.sampled_from(["deepspeed", "horovod"]))
def test_hostfile_reads_back(hosts, form):
    assume(not all(spare for _, _, spare in hosts))
    lines = []
    for name, slots, spare in hosts:
        if slots is None:
            lines.append(name)
        else:
            lines.append(f"{name} slots={slots}" if form == "deepspeed" else f"{name}:{slots}")
        lines[-1] += " spare" if spare else ""
    expected = [Host(name, None if slots is None else tuple(range(slots)), spare) for name, slots, spare in hosts]
    assert parse_hostfile("\n".join(lines) + "\n", "h") == expected


@FEW
@given(st.dictionaries(HOST_NAME, st.one_of(st.none(), st.sets(st.integers(0, 99), min_size=1)), min_size=1,
                       max_size=6))
def test_host_filter_reads_back(wanted):
    text = "@".join(name if slots is None else f"{name}:{','.join(map(str, slots))}" for name, slots in wanted.items())
    assert parse_host_filter(text, "--include") == {
        name: None if slots is None else tuple(sorted(slots)) for name, slots in wanted.items()}


@FEW
@given(st.lists(HOST_NAME, min_size=1, max_size=6, unique=True), st.data())
def test_slurm_plan_of_a_good_allocation(hosts, data):
    rank = data.draw(st.integers(0, len(hosts) - 1))
    plan = slurm_plan({"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": ",".join(hosts), "SLURM_NNODES": str(len(hosts)),
                       "SLURM_NODEID": str(rank)})
    assert plan.hosts == tuple(hosts) and plan.node_rank == rank and plan.endpoint.host == hosts[0]


@FEW
@given(TEXT, TEXT, st.binary(min_size=16, max_size=64), st.binary(min_size=16, max_size=64), TEXT)
def test_a_sealed_message_opens_with_its_key_and_token_only(body, key, token, other_token, other_key):
    sealed = Signer(token).seal(key, body)
    assert Signer(token).open(key, sealed) == body
    assert Signer(token).open(key, sealed.encode()) == body
    if other_key != key:
        with pytest.raises(Forged):
            Signer(token).open(other_key, sealed)
    if other_token != token:
        with pytest.raises(Forged):
            Signer(other_token).open(key, sealed)
