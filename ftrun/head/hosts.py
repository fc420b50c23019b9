"""Which hosts a job runs on: hostfiles, ``--include``/``--exclude`` and Slurm node lists.

Pure parsing, no network: every problem is a ``UsageError`` naming the file, line
or flag, and the text that could not be read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ftrun.errors import UsageError

#: a host as ssh takes it: optional user@, then a name or an IPv4 address; never starting with '-'
#: (ssh would read it as an option)
_HOST = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9._-]*@)?[A-Za-z0-9][A-Za-z0-9._-]*$")
_COUNT = re.compile(r"^[0-9]+$")
#: a device or node index int() reads at once (it refuses 4300 digits and more)
_INDEX = re.compile(r"^[0-9]{1,18}$")
#: the most devices a hostfile line may give (slots=N): more is a typo, and would fill memory with device ids
MAX_HOST_DEVICES = 100_000
#: the most hosts a node list may name (Slurm's largest clusters have some tens of thousands)
MAX_HOSTS = 100_000


@dataclass(frozen=True)
class Host:
    """One hostfile line, after ``--include``/``--exclude``.

    A hostfile's ``slots`` (DeepSpeed's and MPI's word) are device indices: ``slots=4`` gives devices
    0-3, one rank each. The file and the messages keep the users' word; the code says devices, since a
    slot in ftrun's code is a node's place in the job (``NodeSlot``).
    """

    name: str
    #: the device indices ranks may use; None: as many as --nproc-per-node says
    devices: tuple[int, ...] | None = None
    #: a standby node: joins the job but runs no ranks until it replaces a lost one
    spare: bool = False

    @property
    def address(self) -> str:
        """The host without the ssh user."""
        return self.name.rpartition("@")[2]


def parse_hostfile(text: str, where: str) -> list[Host]:
    """Hosts in file order: ``host slots=N [spare]`` (DeepSpeed/MPI), ``host:N`` (Horovod), or ``host``."""
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            host = _parse_host_line(line)
        except UsageError as e:
            raise UsageError(f"{where}, line {number}: {e.message}") from None
        if host.address in seen:  # user@n1 and n1 are one machine: two agents there would clash
            raise UsageError(f"{where}, line {number}: host '{host.address}' is already listed on line "
                             f"{seen[host.address]}")
        seen[host.address] = number
        hosts.append(host)
    if not hosts:
        raise UsageError(f"{where} lists no hosts")
    return hosts


def _parse_host_line(line: str) -> Host:
    words = line.split()
    name, count, spare, most = words[0], None, False, None
    if ":" in name:  # Horovod: host:N
        name, _, text = name.partition(":")
        count = _device_count(text)
    check_host_name(name)
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if word == "spare":
            spare = True
        elif sep and key == "slots" and count is None:
            count = _device_count(value)
        elif sep and key == "max_slots":  # Open MPI's; ftrun runs `slots` ranks
            most = _device_count(value)
        elif sep and key == "slots":
            raise UsageError(f"host '{name}' gives its slots twice")
        else:
            raise UsageError(f"unexpected '{word}' (expected slots=N or spare)")
    if count is not None and most is not None and count > most:
        raise UsageError(f"host '{name}' gives slots={count} above max_slots={most}")
    return Host(name, tuple(range(count)) if count is not None else None, spare)


def check_host_name(name: str) -> None:
    if not _HOST.match(name) or not _labels_fit(name.rpartition("@")[2]):
        raise UsageError(f"'{name}' is not a host name (letters, digits, '.', '-', '_', optionally user@)")


def _labels_fit(host: str) -> bool:
    """Whether the resolver takes ``host``: for an empty label ("a..b") or one over 63 characters it
    raises UnicodeError, which callers expecting socket.gaierror would not catch."""
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return True


def _device_count(text: str) -> int:
    """A hostfile's ``slots=N``, ``max_slots=N`` or ``host:N``: how many devices."""
    if not _COUNT.match(text) or not text.strip("0"):
        raise UsageError(f"slots must be a whole number of at least 1, got '{text}'")
    if not _INDEX.match(text) or int(text) > MAX_HOST_DEVICES:
        raise UsageError(f"slots must be at most {MAX_HOST_DEVICES}, got '{text}'")
    return int(text)


def parse_host_filter(text: str, flag: str) -> dict[str, tuple[int, ...] | None]:
    """DeepSpeed's ``h1@h2:0,2`` (hosts joined by @, optional slot list): host -> devices, None = all.

    Host names may use Slurm's bracket ranges (``n[01-04]``).
    """
    selected: dict[str, tuple[int, ...] | None] = {}
    for part in text.split("@"):
        part = part.strip()
        if not part:
            raise UsageError(f"{flag}: empty host in '{text}'")
        name, sep, devices_text = part.partition(":")
        devices = None
        if sep:
            parts = [s.strip() for s in devices_text.split(",")]
            if not all(_INDEX.match(p) for p in parts):
                raise UsageError(f"{flag}: slots of '{name}' must be whole numbers like 0,2, got '{devices_text}'")
            devices = tuple(sorted({int(p) for p in parts}))
        for host in expand_nodelist(name, flag):
            if host in selected:
                raise UsageError(f"{flag}: host '{host}' is named twice (give its slots once: {host}:0,1)")
            selected[host] = devices
    return selected


def select_hosts(hosts: list[Host], include: str = "", exclude: str = "") -> list[Host]:
    """The hosts and devices left after ``--include`` or ``--exclude`` (not both)."""
    if include and exclude:
        raise UsageError("--include and --exclude cannot be combined")
    if not include and not exclude:
        return list(hosts)
    flag = "--include" if include else "--exclude"
    wanted = parse_host_filter(include or exclude, flag)
    by_name = {h.name: h for h in hosts} | {h.address: h for h in hosts}
    for name, devices in wanted.items():
        if name not in by_name:
            raise UsageError(f"{flag}: host '{name}' is not in the hostfile")
        known = by_name[name].devices
        bad = [d for d in devices or () if known is not None and d not in known]
        if bad:
            raise UsageError(f"{flag}: host '{name}' has no slot {bad[0]} (slots 0-{len(known) - 1})")
        if devices is not None and known is None:
            raise UsageError(f"{flag}: host '{name}' has no slots= in the hostfile to choose from")
    chosen = []
    for host in hosts:
        named = host.name in wanted or host.address in wanted
        chosen_devices = wanted.get(host.name, wanted.get(host.address))
        if include:
            if named:
                chosen.append(Host(host.name, host.devices if chosen_devices is None else chosen_devices, host.spare))
        elif not named:
            chosen.append(host)
        elif chosen_devices is not None:
            left = tuple(d for d in host.devices if d not in chosen_devices)
            if left:
                chosen.append(Host(host.name, left, host.spare))
    if not chosen:
        raise UsageError(f"{flag} leaves no host to run on")
    return chosen


def expand_nodelist(text: str, where: str = "node list") -> list[str]:
    """Slurm's compressed node list: ``n[01-03,07]``, ``a1,b[2-3]``, ``r[1-2]n[1-2]``; zero padding kept."""
    names: list[str] = []
    for part in _split_top_level(text.strip(), where):
        names.extend(_expand_one(part, where))
        if len(names) > MAX_HOSTS:
            raise UsageError(f"{where}: '{text}' names more than {MAX_HOSTS} hosts")
    if not names:
        raise UsageError(f"{where}: no hosts in '{text}'")
    return names


def _split_top_level(text: str, where: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
            if depth > 1:
                raise UsageError(f"{where}: nested '[' in '{text}'")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise UsageError(f"{where}: ']' without '[' in '{text}'")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise UsageError(f"{where}: '[' without ']' in '{text}'")
    parts.append(current)
    if any(not p.strip() for p in parts):
        raise UsageError(f"{where}: empty host name in '{text}'")
    return [p.strip() for p in parts]


def _expand_one(part: str, where: str) -> list[str]:
    """``r[1-2]n[01-02]``: every combination, first group outermost. A loop, not recursion, and a
    bound on the product: ``a[1]`` 1000 times, or ``r[1-99999]n[1-99999]``, must be an error, not a crash."""
    names, rest = [""], part
    while "[" in rest:
        start = rest.index("[")
        end = rest.index("]", start)
        values = _range_values(rest[start + 1:end], part, where)
        if len(names) * len(values) > MAX_HOSTS:
            raise UsageError(f"{where}: '{part}' names more than {MAX_HOSTS} hosts")
        names = [name + rest[:start] + value for name in names for value in values]
        rest = rest[end + 1:]
    return [name + rest for name in names]


def _range_values(ranges: str, part: str, where: str) -> list[str]:
    """``01-03,07`` -> ``["01", "02", "03", "07"]``; zero padding kept."""
    values: list[str] = []
    for item in ranges.split(","):
        low, sep, high = item.strip().partition("-")
        if not _INDEX.match(low) or (sep and not _INDEX.match(high)):
            raise UsageError(f"{where}: bad range '{item}' in '{part}'")
        if not sep:
            values.append(low)
            continue
        if int(high) < int(low):
            raise UsageError(f"{where}: range '{item}' in '{part}' runs backwards")
        if len(values) + int(high) - int(low) >= MAX_HOSTS:
            raise UsageError(f"{where}: range '{item}' in '{part}' is too long")
        width = len(low) if low.startswith("0") else 0
        values.extend(f"{n:0{width}d}" for n in range(int(low), int(high) + 1))
    return values
