"""Hostfiles, Slurm node lists and ``--include``/``--exclude`` (pure parsing)."""

from __future__ import annotations

import pytest

from ftrun.errors import ExitCode, UsageError
from ftrun.head.hosts import Host, expand_nodelist, parse_host_filter, parse_hostfile, select_hosts


def usage_error(call, *args, **kwargs) -> str:
    """The message of the UsageError the call raises."""
    with pytest.raises(UsageError) as caught:
        call(*args, **kwargs)
    assert caught.value.exit_code == ExitCode.USAGE
    return caught.value.message


# --- hostfiles -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, expected",
    [
        ("n1", Host("n1")),
        ("n1 slots=4", Host("n1", (0, 1, 2, 3))),
        ("n1:2", Host("n1", (0, 1))),
        ("n1 slots=2 spare", Host("n1", (0, 1), spare=True)),
        ("n1 spare slots=2", Host("n1", (0, 1), spare=True)),
        ("n1:3 spare", Host("n1", (0, 1, 2), spare=True)),
        ("n1 spare", Host("n1", None, spare=True)),
        ("n1 slots=2 max_slots=8", Host("n1", (0, 1))),
        ("n1 max_slots=8", Host("n1")),
        ("alice@n1 slots=1", Host("alice@n1", (0,))),
        ("alice@n1:2", Host("alice@n1", (0, 1))),
        ("10.0.0.7 slots=1", Host("10.0.0.7", (0,))),
        ("gpu-node_3.cluster.local", Host("gpu-node_3.cluster.local")),
        ("  n1 \t slots=2  ", Host("n1", (0, 1))),
        ("n1 slots=2 # the big one", Host("n1", (0, 1))),
        ("n1#no space before the comment", Host("n1")),
    ],
)
def test_hostfile_line_forms(line, expected):
    assert parse_hostfile(line, "hosts") == [expected]


def test_hostfile_keeps_file_order_and_skips_comments_and_blank_lines():
    text = "# the cluster\n\nn2 slots=2\n   \n  # indented comment\nn1:1\r\nalice@n3 spare\n"
    assert parse_hostfile(text, "hosts") == [Host("n2", (0, 1)), Host("n1", (0,)), Host("alice@n3", None, True)]


@pytest.mark.parametrize(
    "host, address",
    [(Host("n1"), "n1"), (Host("alice@n1", (0,)), "n1"), (Host("alice@10.0.0.7"), "10.0.0.7")],
)
def test_host_address_drops_the_ssh_user(host, address):
    assert host.address == address


@pytest.mark.parametrize(
    "line, words",
    [
        ("n1 slots=0", ["slots", "'0'"]),
        ("n1 slots=-2", ["slots", "'-2'"]),
        ("n1 slots=two", ["slots", "'two'"]),
        ("n1 slots=1.5", ["slots", "'1.5'"]),
        ("n1 slots=", ["slots", "''"]),
        ("n1:0", ["slots", "'0'"]),
        ("n1:-1", ["slots", "'-1'"]),
        ("n1:x", ["slots", "'x'"]),
        ("n1:", ["slots", "''"]),
        ("n1 max_slots=none", ["slots", "'none'"]),
        ("n1 slots=2 slots=3", ["'n1'", "twice"]),
        ("n1:2 slots=3", ["'n1'", "twice"]),
        ("n1 gpus=2", ["unexpected 'gpus=2'"]),
        ("n1 slots", ["unexpected 'slots'"]),
        ("n1 standby", ["unexpected 'standby'"]),
        ("n1 n2", ["unexpected 'n2'"]),
        ("-oProxyCommand=evil", ["'-oProxyCommand=evil'", "not a host name"]),
        ("-n1 slots=1", ["'-n1'", "not a host name"]),
        ("alice@-n1", ["'alice@-n1'", "not a host name"]),
        ("n1;reboot", ["'n1;reboot'", "not a host name"]),
        ("$HOST slots=2", ["'$HOST'", "not a host name"]),
        ("n`id`", ["not a host name"]),
        ("n1|tee", ["not a host name"]),
        ("@n1", ["'@n1'", "not a host name"]),
    ],
)
def test_bad_hostfile_line_is_named_with_its_file_and_line_number(line, words):
    message = usage_error(parse_hostfile, f"# header\n\n{line}\n", "hostfile /etc/hosts.txt")
    assert message.startswith("hostfile /etc/hosts.txt, line 3: ")
    for word in words:
        assert word in message


def test_duplicate_host_names_both_lines():
    message = usage_error(parse_hostfile, "n1 slots=2\nn2\n# n1 again\nn1 slots=4\n", "hosts.txt")
    assert message == "hosts.txt, line 4: host 'n1' is already listed on line 1"


@pytest.mark.parametrize("text", ["n1\nalice@n1\n", "alice@n1\nbob@n1\n"])
def test_one_machine_under_two_users_is_a_duplicate(text):
    assert usage_error(parse_hostfile, text, "hosts.txt") == "hosts.txt, line 2: host 'n1' is already listed on line 1"


def test_slot_counts_take_ascii_digits_only():
    assert "slots" in usage_error(parse_hostfile, "n1 slots=\u0663\n", "hosts.txt")


def test_duplicate_horovod_and_deepspeed_forms_of_one_host_clash():
    assert "already listed on line 1" in usage_error(parse_hostfile, "n1:2\nn1 slots=2\n", "hosts.txt")


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "   # n1 slots=2\n\t\n"])
def test_hostfile_without_hosts_is_an_error(text):
    assert usage_error(parse_hostfile, text, "hostfile h.txt") == "hostfile h.txt lists no hosts"


# --- Slurm node lists ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("n1", ["n1"]),
        ("n1,n2", ["n1", "n2"]),
        (" a1 , b2 ", ["a1", "b2"]),
        ("n[01-03,07]", ["n01", "n02", "n03", "n07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[0-2]", ["n0", "n1", "n2"]),
        ("n[5]", ["n5"]),
        ("n[3-3]", ["n3"]),
        ("n[1, 3-4]", ["n1", "n3", "n4"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("rack[1-2]-gpu", ["rack1-gpu", "rack2-gpu"]),
        ("[1-2]x", ["1x", "2x"]),
        ("a[1-2],b[01-02],c", ["a1", "a2", "b01", "b02", "c"]),
        ("gpu-[1-2].cluster", ["gpu-1.cluster", "gpu-2.cluster"]),
    ],
)
def test_nodelist_expansion(text, expected):
    assert expand_nodelist(text) == expected


def test_nodelist_long_range_expands_in_order():
    names = expand_nodelist("n[0001-1000]")
    assert len(names) == 1000 and names[0] == "n0001" and names[-1] == "n1000"


@pytest.mark.parametrize(
    "text, words",
    [
        ("n[1-3", ["'[' without ']'"]),
        ("n1-3]", ["']' without '['"]),
        ("n]1[", ["']' without '['"]),
        ("n[1-2],m[3", ["'[' without ']'"]),
        ("n[1[2-3]]", ["nested '['"]),
        ("n[3-1]", ["'3-1'", "backwards"]),
        ("n[10-09]", ["'10-09'", "backwards"]),
        ("n[a-c]", ["bad range 'a-c'"]),
        ("n[1-b]", ["bad range '1-b'"]),
        ("n[1-]", ["bad range '1-'"]),
        ("n[-3]", ["bad range '-3'"]),
        ("n[]", ["bad range ''"]),
        ("n[1,,2]", ["bad range ''"]),
        ("n[1-2-3]", ["bad range '1-2-3'"]),
        ("n[1.5]", ["bad range '1.5'"]),
        ("n[1-200000]", ["too long"]),
        ("a,,b", ["empty host name"]),
        ("a,", ["empty host name"]),
        (",a", ["empty host name"]),
        ("a, ,b", ["empty host name"]),
        ("", ["empty host name"]),
    ],
)
def test_bad_nodelist_names_where_and_what(text, words):
    message = usage_error(expand_nodelist, text, "SLURM_JOB_NODELIST")
    assert message.startswith("SLURM_JOB_NODELIST: ")
    for word in words:
        assert word in message


# --- --include / --exclude -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("n1", {"n1": None}),
        ("n1@n2", {"n1": None, "n2": None}),
        ("n1:0,2@n2", {"n1": (0, 2), "n2": None}),
        ("n1:2,0,2", {"n1": (0, 2)}),
        (" n1 @ n2:1 ", {"n1": None, "n2": (1,)}),
        ("n[1-3]", {"n1": None, "n2": None, "n3": None}),
        ("n[1-2]:1", {"n1": (1,), "n2": (1,)}),
        ("n[01-02]@m5:0", {"n01": None, "n02": None, "m5": (0,)}),
    ],
)
def test_host_filter_forms(text, expected):
    assert parse_host_filter(text, "--include") == expected


@pytest.mark.parametrize(
    "text, words",
    [
        ("n1@@n2", ["empty host in 'n1@@n2'"]),
        ("n1@", ["empty host"]),
        ("@n1", ["empty host"]),
        ("", ["empty host"]),
        ("n1:", ["'n1'", "whole numbers", "''"]),
        ("n1:a", ["'n1'", "whole numbers", "'a'"]),
        ("n1:0,,1", ["'n1'", "whole numbers"]),
        ("n1:1.5", ["'n1'", "whole numbers"]),
        ("n1:-1", ["'n1'", "whole numbers", "'-1'"]),
        ("n1:0@n1:1", ["'n1' is named twice"]),
        ("n1@n[1-2]", ["'n1' is named twice"]),
        ("n[1-3:0", ["'[' without ']'"]),
        ("n[3-1]", ["backwards"]),
    ],
)
def test_bad_host_filter_names_the_flag(text, words):
    message = usage_error(parse_host_filter, text, "--exclude")
    assert message.startswith("--exclude")
    for word in words:
        assert word in message


HOSTFILE = """\
n1 slots=4
n2 slots=2 spare
alice@n3 slots=2
n4
"""


@pytest.fixture
def hosts() -> list[Host]:
    return parse_hostfile(HOSTFILE, "hosts")


def test_no_filter_keeps_every_host(hosts):
    selected = select_hosts(hosts)
    assert selected == hosts and selected is not hosts


@pytest.mark.parametrize(
    "include, expected",
    [
        ("n1", [Host("n1", (0, 1, 2, 3))]),
        ("n4@n1", [Host("n1", (0, 1, 2, 3)), Host("n4")]),
        ("n1:3,1", [Host("n1", (1, 3))]),
        ("n2:1", [Host("n2", (1,), spare=True)]),
        ("n3", [Host("alice@n3", (0, 1))]),
        ("n3:1", [Host("alice@n3", (1,))]),
        ("n[1-2]:0", [Host("n1", (0,)), Host("n2", (0,), spare=True)]),
        ("n[1-4]", [Host("n1", (0, 1, 2, 3)), Host("n2", (0, 1), True), Host("alice@n3", (0, 1)), Host("n4")]),
    ],
)
def test_include_keeps_only_the_listed_hosts_and_slots_in_hostfile_order(hosts, include, expected):
    assert select_hosts(hosts, include=include) == expected


@pytest.mark.parametrize(
    "exclude, expected",
    [
        ("n1", ["n2", "alice@n3", "n4"]),
        ("n1@n4", ["n2", "alice@n3"]),
        ("n3", ["n1", "n2", "n4"]),
        ("n[1-3]", ["n4"]),
    ],
)
def test_exclude_drops_whole_hosts(hosts, exclude, expected):
    assert [h.name for h in select_hosts(hosts, exclude=exclude)] == expected


@pytest.mark.parametrize(
    "exclude, left",
    [
        ("n1:0", {"n1": (1, 2, 3)}),
        ("n1:1,3", {"n1": (0, 2)}),
        ("n2:0", {"n2": (1,)}),
        ("n3:0", {"alice@n3": (1,)}),
        ("n1:0@n3:1", {"n1": (1, 2, 3), "alice@n3": (0,)}),
    ],
)
def test_exclude_slots_keeps_the_rest_of_the_host(hosts, exclude, left):
    selected = {h.name: h for h in select_hosts(hosts, exclude=exclude)}
    assert list(selected) == ["n1", "n2", "alice@n3", "n4"]
    for name, slots in left.items():
        assert selected[name].devices == slots
    assert selected["n2"].spare and not selected["n1"].spare


def test_exclude_every_slot_of_a_host_drops_it(hosts):
    selected = select_hosts(hosts, exclude="n1:0,1,2,3@n2:0,1")
    assert selected == [Host("alice@n3", (0, 1)), Host("n4")]


@pytest.mark.parametrize(
    "include, exclude, expected",
    [
        ("n1", "n2", "--include and --exclude cannot be combined"),
        ("", "n1@n2@n3@n4", "--exclude leaves no host to run on"),
        ("", "n[1-4]", "--exclude leaves no host to run on"),
        ("", "n1:0,1,2,3@n2@n3:0,1@n4", "--exclude leaves no host to run on"),
        ("n9", "", "--include: host 'n9' is not in the hostfile"),
        ("", "n1@n9", "--exclude: host 'n9' is not in the hostfile"),
        ("", "m[1-2]", "--exclude: host 'm1' is not in the hostfile"),
        ("alice", "", "--include: host 'alice' is not in the hostfile"),
        # '@' joins hosts, so a filter cannot carry the ssh user: this names 'alice' and 'n3'
        ("alice@n3", "", "--include: host 'alice' is not in the hostfile"),
        ("n1:4", "", "--include: host 'n1' has no slot 4 (slots 0-3)"),
        ("", "n2:1,2", "--exclude: host 'n2' has no slot 2 (slots 0-1)"),
        ("n4:0", "", "--include: host 'n4' has no slots= in the hostfile to choose from"),
        ("", "n4:0", "--exclude: host 'n4' has no slots= in the hostfile to choose from"),
    ],
)
def test_filter_errors(hosts, include, exclude, expected):
    assert usage_error(select_hosts, hosts, include=include, exclude=exclude) == expected

