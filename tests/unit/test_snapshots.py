"""Snapshots: the file format, a rank's writer, the restore plan, transfers between agents, persistence."""

from __future__ import annotations

import collections
import dataclasses
import fractions
import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

from ftrun.auth import Signer
from ftrun.messages import from_json, to_json
from ftrun.elastic.arrays import TorchSnapshotWriter, load_first_good, load_own, load_source, own_steps
from ftrun.snapshots.format import (
    HEADER_SIZE, WRITING, SnapshotError, SnapshotTooLarge, lay_out, load_states, read_header, read_verified, verified,
)
from ftrun.snapshots.keeper import SnapshotKeeper, SnapshotOptions, ring_peers
from ftrun.snapshots.persist import persist
from ftrun.snapshots.plan import (
    DISK, MEMORY, PINNED, REPLICA, HeldSnapshot, RestorePlan, RestoreSource, SnapshotInventory, choose_restore,
)
from ftrun.snapshots.transfer import TransferError, get, put
from tests.parts import unavailable


def states(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "extra": {"bf16": torch.arange(6, dtype=torch.bfloat16).view(2, 3), "empty": torch.empty(0, 2),
                      "scalar": torch.tensor(7, dtype=torch.int64), "flag": torch.tensor([True, False]),
                      "strided": torch.arange(12.0).view(3, 4).t(), "nested": [(1, "a"), {2: None}], "lr": 0.5}}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def writer(folder, rank: int = 0, limit: int = 0, sharded: bool = True) -> TorchSnapshotWriter:
    return TorchSnapshotWriter(str(folder), rank, 4, sharded, every=1, limit=limit, copies=6)


# -- the format ----------------------------------------------------------------------------------------


def test_a_snapshot_gives_back_every_tensor_and_value_exactly(tmp_path):
    original = states()
    write = writer(tmp_path)
    write.write(3, original)
    write.wait()
    header, blob = read_verified(write.paths[0])
    assert (header.step, header.rank, header.world_size, header.sharded) == (3, 0, 4, True)
    loaded = load_states(header, blob)
    assert same(loaded, original)
    assert isinstance(loaded["model"], collections.OrderedDict)  # load_state_dict keeps working on it


def test_a_structure_with_code_in_it_is_refused_at_the_snapshot_not_at_the_restore():
    class Custom:
        pass

    with pytest.raises(SnapshotError, match="cannot snapshot the registered state: .*Custom"):
        lay_out({"model": {"thing": Custom()}})
    with pytest.raises(SnapshotError, match="not fractions.Fraction"):
        lay_out({"sampler": {"share": fractions.Fraction(1, 3)}})


def test_a_snapshot_file_cannot_run_code(tmp_path):
    write = writer(tmp_path)
    write.write(1, {"x": {"a": torch.zeros(2)}})
    write.wait()
    header, blob = read_verified(write.paths[0])
    evil = pickle.dumps((os.system, ("true",)))
    blob[HEADER_SIZE:HEADER_SIZE + len(evil)] = evil
    with pytest.raises(SnapshotError, match="posix.system|os.system"):
        load_states(header, blob)


def test_damaged_cut_short_and_unfinished_snapshots_are_refused(tmp_path):
    write = writer(tmp_path)
    write.write(5, states())
    write.wait()
    path = write.paths[0]
    blob = bytearray(open(path, "rb").read())
    assert verified(bytearray(blob), "x")[0].step == 5
    damaged = bytearray(blob)
    damaged[-3] ^= 0x01
    with pytest.raises(SnapshotError, match="step 5 fails its checksum"):
        verified(damaged, "x")
    with pytest.raises(SnapshotError, match="cut short"):
        verified(blob[:-10], "x")
    with pytest.raises(SnapshotError, match="not a snapshot"):
        verified(bytearray(b"garbage" * 100), "x")
    packed = dataclasses.replace(read_header(path), state=WRITING).pack()
    unfinished = bytearray(blob)
    unfinished[:len(packed)] = packed
    with pytest.raises(SnapshotError, match="never finished"):
        verified(unfinished, "x")


def test_a_snapshot_over_the_memory_share_is_a_clear_error(tmp_path):
    with pytest.raises(SnapshotTooLarge, match=r"rank 0's snapshot takes .* MiB, but its share of --snapshot-memory "
                                               r"is 4.0 KiB .*6 copies.*raise --snapshot-memory"):
        writer(tmp_path, limit=4096).write(1, {"big": {"w": torch.zeros(1 << 18)}})
    assert not os.path.exists(writer(tmp_path).paths[0])  # nothing half-written left


@pytest.fixture
def small_shared_memory(tmp_path):
    """A 1 MiB tmpfs, as a /dev/shm that other programs have nearly filled."""
    folder = tmp_path / "shm"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        unavailable(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_no_room_in_shared_memory_skips_the_snapshot_and_keeps_the_last(small_shared_memory, caplog):
    write = writer(small_shared_memory, rank=1)
    small, big = {"m": {"w": torch.full((1000,), 1.0)}}, {"m": {"w": torch.zeros(1 << 18)}}  # 1 MiB of data
    assert write.write(1, small) and write.write(2, small)
    write.wait()
    assert not write.write(3, big) and not write.write(4, big)
    assert [r.message for r in caplog.records].count(
        "rank 1: no room in %s for the snapshot of step 3 (1.0 MiB: No space left on device); training goes on, and "
        "the last snapshot stays; free shared memory, or lower --snapshot-memory or --snapshot-replicas"
        % small_shared_memory) == 1, caplog.text  # once, not at every step
    assert own_steps(str(small_shared_memory), 1) == [2]  # the one being replaced is gone, the newest stays
    assert sum(os.path.getsize(p) for p in write.paths) < 64 << 10  # the failed file gave its pages back
    assert write.write(5, small)
    write.wait()
    assert own_steps(str(small_shared_memory), 1) == [5, 2] and same(load_own(str(small_shared_memory), 1, 5), small)
    assert "rank 1: snapshots resumed at step 5 (skipped since step 3 for want of shared memory)" in caplog.text


# -- a rank's two files --------------------------------------------------------------------------------


def test_the_writer_takes_turns_and_keeps_the_snapshot_it_restored_from(tmp_path):
    write = writer(tmp_path, rank=2)
    for step in (1, 2, 3):
        write.write(step, states(step))
    write.wait()
    assert own_steps(str(tmp_path), 2) == [3, 2]
    assert same(load_own(str(tmp_path), 2, 2), states(2))
    with pytest.raises(SnapshotError, match="step 1 is gone"):
        load_own(str(tmp_path), 2, 1)
    # a replacement rank finds its predecessor's files and writes over the older one
    again = writer(tmp_path, rank=2)
    again.write(4, states(4))
    again.wait()
    assert own_steps(str(tmp_path), 2) == [4, 3]
    # back to step 3: step 4 belongs to the abandoned run; the next write keeps step 3
    again.resume_at(3)
    assert own_steps(str(tmp_path), 2) == [3]
    again.write(4, states(40))
    again.wait()
    assert own_steps(str(tmp_path), 2) == [4, 3] and same(load_own(str(tmp_path), 2, 4), states(40))


def test_tensors_copied_behind_the_loop_are_those_of_the_snapshot_s_step(tmp_path):
    """The parameters are copied by a thread; once wait_copied() returns (the optimizer's pre-hook),
    changing them no longer changes the snapshot, and the buffers were copied before write() returned."""
    original = states()
    expected = collections.OrderedDict((k, v.clone()) for k, v in original["model"].items())
    params = frozenset(v.data_ptr() for k, v in original["model"].items() if "running" not in k)
    write = writer(tmp_path)
    write.write(1, original, behind=params)
    for name, value in original["model"].items():  # the next forward changes the buffers at once
        if "running" in name:
            value.add_(100)
    write.wait_copied()
    for value in original["model"].values():  # the optimizer's step, after its pre-hook
        value.add_(1)
    write.wait()
    header, blob = read_verified(write.paths[0])
    assert same(load_states(header, blob)["model"], expected)
    assert len(write.blocked) == 1 and write.blocked[0] > 0


KILLED_WRITER = """
import sys, torch
from ftrun.elastic.arrays import TorchSnapshotWriter
write = TorchSnapshotWriter(sys.argv[1], 0, 1, True, every=1, limit=0, copies=2)
big = {"model": {"w": torch.zeros(16 << 20)}}  # 64 MiB; after step k every element is k
step = 0
while True:
    step += 1
    big["model"]["w"].add_(1)
    write.write(step, big)
"""


def test_a_rank_killed_while_writing_leaves_its_previous_snapshot_usable(tmp_path):
    """A real process writing 64 MiB snapshots in a loop is SIGKILLed while one of its files is unfinished."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)])
    paths = [str(tmp_path / f"rank-00000.{i}") for i in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            headers = [read_header(p) for p in paths]
            if all(headers) and min(h.step for h in headers) >= 2 and any(not h.complete for h in headers):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
        else:
            pytest.fail("never saw a snapshot being written")
    finally:
        proc.kill()
        proc.wait()
    headers = [read_header(p) for p in paths]
    unfinished = [p for p, h in zip(paths, headers) if not h.complete]
    assert len(unfinished) == 1  # the one being written when the rank died
    with pytest.raises(SnapshotError):
        read_verified(unfinished[0])
    (good,) = own_steps(str(tmp_path), 0)
    assert good == max(h.step for h in headers) - 1  # the step before the one being written
    restored = load_own(str(tmp_path), 0, good)["model"]["w"]
    assert restored.numel() == 16 << 20 and bool((restored == good).all())


# -- the restore plan ----------------------------------------------------------------------------------


def held(rank, step, where=MEMORY, sharded=True, world=4):
    return HeldSnapshot(rank, step, world, sharded, where, f"/{where}/{rank}/{step}")


def inventory(node, *copies):
    return SnapshotInventory(f"agent{node}", node, f"h{node}:1", tuple(copies))


HOMES = {0: 0, 1: 0, 2: 1, 3: 1}


def all_sources(restore):
    """Every rank's source, from the node plans, in rank order."""
    return sorted((source for _, plan in restore.plans() for source in plan.sources), key=lambda s: s.rank)


def test_the_plan_takes_the_newest_step_every_rank_has_and_the_nearest_copy():
    plan = choose_restore(3, [
        inventory(0, held(0, 12), held(0, 11), held(1, 12), held(1, 11), held(2, 8, REPLICA), held(3, 8, REPLICA),
                  held(0, 8, PINNED), held(1, 8, PINNED)),
        inventory(1, held(2, 12), held(2, 11), held(3, 11), held(0, 8, REPLICA), held(1, 8, REPLICA),
                  held(2, 8, PINNED), held(3, 8, PINNED)),
    ], 4, HOMES)
    assert plan.step == 11  # rank 3 has no step 12
    assert [(s.rank, s.node_rank, s.where) for s in all_sources(plan)] == [
        (0, 0, MEMORY), (1, 0, MEMORY), (2, 1, MEMORY), (3, 1, MEMORY)]
    # node 1 lost: its ranks' replicas on node 0 decide the step
    plan = choose_restore(3, [inventory(0, held(0, 12), held(1, 12), held(2, 8, REPLICA), held(3, 8, REPLICA),
                                        held(0, 8, PINNED), held(1, 8, PINNED))], 4, HOMES)
    assert plan.step == 8 and plan.counts() == {PINNED: 2, REPLICA: 2}
    assert plan.source_of(2).address == "h0:1"


def test_memory_wins_over_disk_and_disk_fills_what_memory_lacks():
    plan = choose_restore(1, [inventory(0, held(0, 10), held(1, 10), held(0, 10, DISK), held(1, 10, DISK),
                                        held(2, 10, DISK), held(3, 10, DISK))], 4, HOMES)
    assert plan.step == 10 and plan.counts() == {MEMORY: 2, DISK: 2}


def test_replicated_state_restores_every_rank_from_any_copy_even_after_a_resize():
    plan = choose_restore(2, [inventory(1, held(3, 9, sharded=False, world=4))], 2, {0: 0, 1: 0})
    assert plan.step == 9 and {s.rank for s in all_sources(plan)} == {0, 1}
    assert {s.path for s in all_sources(plan)} == {"/memory/3/9"}


def test_replicated_state_is_read_on_each_rank_s_own_node_else_from_the_best_copy_anywhere():
    copies = [inventory(0, held(1, 9, DISK, sharded=False), held(0, 9, DISK, sharded=False)),
              inventory(1, held(3, 9, DISK, sharded=False), held(2, 9, sharded=False)),
              inventory(2, held(5, 9, PINNED, sharded=False))]
    plan = choose_restore(2, copies, 8, {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 3, 6: 3})
    # node 0: the lower of two disk copies; node 1: memory before disk; node 2 its own; nodes 3 and
    # none (rank 7): the best anywhere, memory on node 1
    assert [(s.rank, s.node_rank, s.path) for s in all_sources(plan)] == [
        (0, 0, "/disk/0/9"), (1, 0, "/disk/0/9"), (2, 1, "/memory/2/9"), (3, 1, "/memory/2/9"),
        (4, 2, "/pinned/5/9"), (5, 1, "/memory/2/9"), (6, 1, "/memory/2/9"), (7, 1, "/memory/2/9")]


def test_sharded_state_is_not_restored_into_another_world_size_and_says_why():
    plan = choose_restore(2, [inventory(0, *(held(r, 9) for r in range(4)))], 2, {0: 0, 1: 0})
    assert plan.step == -1 and "every one of the 2 ranks" in plan.reason
    assert choose_restore(2, [], 4, HOMES).reason == "no snapshot is held anywhere"


def test_the_plan_names_spare_copies_and_leaves_out_those_a_rank_found_damaged():
    both = [inventory(0, held(0, 12), held(1, 12), held(2, 12, REPLICA), held(3, 12, REPLICA), held(0, 8, PINNED),
                      held(1, 8, PINNED), held(2, 8, REPLICA), held(3, 8, REPLICA)),
            inventory(1, held(2, 12), held(3, 12), held(0, 12, REPLICA), held(1, 12, REPLICA))]
    plan = choose_restore(3, both, 4, HOMES)
    assert plan.sharded and plan.step == 12
    assert [(s.node_rank, s.where) for s in plan.sources_for(2)] == [(1, MEMORY), (0, REPLICA)]  # its own shard only
    assert {s.rank for s in plan.sources_for(0)} == {0}
    node1 = plan.plan_for(1)  # what ranks 2 and 3 read: their own sources and spares, none of node 0's ranks'
    assert [s.rank for s in node1.sources] == [2, 3] and {s.rank for s in node1.spares} == {2, 3}
    assert from_json(RestorePlan, to_json(node1)) == node1  # the spares go through the store with it
    # rank 2 found its memory copy damaged: the next plan reads the replica instead
    damaged = {plan.source_of(2).identity}
    plan = choose_restore(4, both, 4, HOMES, frozenset(damaged))
    assert plan.step == 12 and (plan.source_of(2).node_rank, plan.source_of(2).where) == (0, REPLICA)
    damaged.add(plan.source_of(2).identity)  # and that one too: step 8 is the newest every rank still has
    plan = choose_restore(5, both, 4, HOMES, frozenset(damaged))
    assert plan.step == 8 and plan.counts() == {PINNED: 2, REPLICA: 2}


def test_replicated_state_names_every_rank_s_copy_as_a_spare_nearest_first():
    plan = choose_restore(1, [inventory(0, held(0, 9, sharded=False), held(1, 9, sharded=False)),
                              inventory(1, held(2, 9, sharded=False), held(3, 9, sharded=False))], 4, HOMES)
    assert not plan.sharded
    order = plan.sources_for(3)
    assert [s.path for s in order] == ["/memory/2/9", "/memory/3/9", "/memory/0/9", "/memory/1/9"]
    assert {s.rank for s in order} == {3}


def test_a_rank_skips_a_damaged_copy_for_the_next_and_reports_it(tmp_path):
    write = writer(tmp_path, rank=0)
    for step in (1, 2):
        write.write(step, states(step))
    write.wait()
    pinned = tmp_path / "pinned-rank-00000"
    pinned.write_bytes(open(write.paths[1], "rb").read())  # step 2, copied aside as the agent pins it
    with open(write.paths[1], "r+b") as f:  # damaged after the agent checked it
        f.seek(HEADER_SIZE + 10)
        f.write(b"\xff\xfe")
    sources = [RestoreSource(0, 0, "127.0.0.1:1", MEMORY, write.paths[1]),
               RestoreSource(0, 0, "127.0.0.1:1", PINNED, str(pinned))]
    reported = []
    source, state = load_first_good(sources, 2, str(tmp_path), Signer(), reported.append)
    assert source.where == PINNED and same(state, states(2))
    assert reported == sources[:1]
    with open(pinned, "r+b") as f:
        f.seek(HEADER_SIZE + 10)
        f.write(b"\xff\xfe")
    reported.clear()
    with pytest.raises(SnapshotError, match=r"every copy of step 2 the restore plan names for rank 0 \(2\) failed"):
        load_first_good(sources, 2, str(tmp_path), Signer(), reported.append)
    assert reported == sources


def test_ring_peers_wrap_around_and_never_include_the_node_itself():
    assert ring_peers([0, 1, 2, 3], 2, 1) == [3]
    assert ring_peers([0, 1, 2, 3], 3, 2) == [0, 1]
    assert ring_peers([0, 1], 0, 5) == [1]
    assert ring_peers([0], 0, 1) == [] and ring_peers([0, 1], 7, 1) == []


# -- agents: pins, replicas, the server ----------------------------------------------------------------


@pytest.fixture
def keepers(tmp_path):
    """Two agents' keepers (nodes 0 and 1) on loopback, signing with one token."""
    made = []

    def make(node: int, token: bytes = b"t" * 32, **options) -> SnapshotKeeper:
        opts = SnapshotOptions(**{"every": 1, "replicas": 1, "replicate_every": 2, "memory": 1 << 30, **options})
        keeper = SnapshotKeeper(opts, f"unit-{os.getpid()}-{node}-{len(made)}", 2, "127.0.0.1", "127.0.0.1",
                                Signer(token), token)
        keeper.start()
        made.append(keeper)
        return keeper

    yield make
    for keeper in made:
        keeper.stop()
        assert not os.path.exists(keeper.folder)


def test_pinned_snapshots_go_to_the_peer_which_serves_them_back(keepers):
    node0, node1 = keepers(0), keepers(1)
    node0.set_peers([(1, node1.address)])
    write = writer(node0.folder, rank=1)
    for step in (1, 2, 3):
        write.write(step, states(step))
    write.wait()
    wait = time.monotonic() + 30
    while time.monotonic() < wait and not node1.inventory("b", 1).held:
        time.sleep(0.05)
    mine = node0.inventory("a", 0, verify=True)
    assert {(h.rank, h.step, h.where) for h in mine.held} == {(1, 3, MEMORY), (1, 2, MEMORY), (1, 2, PINNED)}
    (replica,) = node1.inventory("b", 1).held
    assert (replica.rank, replica.step, replica.where) == (1, 2, REPLICA)
    # a rank on another node reads it through node 1's server, checked
    source = RestoreSource(1, 1, node1.address, REPLICA, replica.path, replica.nbytes, replica.crc)
    assert same(load_source(source, 2, "/nonexistent", Signer(b"t" * 32)), states(2))


def test_the_server_refuses_strangers_and_files_outside_its_folders(keepers, tmp_path):
    node0 = keepers(0)
    secret = tmp_path / "secret"
    secret.write_text("x")
    with pytest.raises(TransferError, match="refused"):
        get(node0.address, Signer(b"w" * 32), os.path.join(node0.folder, "rank-00000.0"))
    with pytest.raises(TransferError, match="not a snapshot this node serves"):
        get(node0.address, Signer(b"t" * 32), str(secret))
    with pytest.raises(TransferError, match="not a snapshot this node serves"):
        get(node0.address, Signer(b"t" * 32), os.path.join(node0.folder, "..", os.path.basename(str(secret))))
    with pytest.raises(TransferError, match="not a snapshot this node serves"):
        get(node0.address, Signer(b"t" * 32), os.path.join(node0.folder, "token"))
    with pytest.raises(TransferError, match="fails its checksum|not a snapshot"):
        put(node0.address, Signer(b"t" * 32), "0", bytearray(b"x" * 5000))
    assert node0.inventory("a", 0).held == ()
    with pytest.raises(TransferError, match="cannot reach"):
        get("127.0.0.1:1", Signer(), "/x")


def test_a_damaged_snapshot_is_left_out_of_the_inventory_once_checked(keepers):
    node0 = keepers(0, replicas=0)
    write = writer(node0.folder, rank=0)
    for step in (1, 2):
        write.write(step, states(step))
    write.wait()
    assert {h.step for h in node0.inventory("a", 0).held if h.where == MEMORY} == {1, 2}
    with open(write.paths[1], "r+b") as f:  # step 2
        f.seek(HEADER_SIZE + 10)
        f.write(b"\xff\xfe")
    assert {h.step for h in node0.inventory("a", 0, verify=True).held if h.where == MEMORY} == {1}
    assert {h.step for h in node0.inventory("a", 0).held if h.where == MEMORY} == {1}  # remembered


# -- persistence ---------------------------------------------------------------------------------------


def test_the_agent_persists_pinned_snapshots_on_the_interval_through_its_persister(tmp_path):
    """--checkpoint-interval: the step grid alone (every 1000 steps) would write nothing here."""
    root = tmp_path / "ckpt"
    options = SnapshotOptions(every=1, replicas=0, replicate_every=2, memory=1 << 30, checkpoint_dir=str(root),
                              checkpoint_every=1000, checkpoint_interval=0.2)

    def spawn(argv):
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    keeper = SnapshotKeeper(options, f"unit-interval-{os.getpid()}", 1, "127.0.0.1", "127.0.0.1", Signer(), b"", spawn)
    keeper.start()
    try:
        write = writer(keeper.folder, rank=0)
        for step in range(1, 9):
            write.write(step, states(step))
            write.wait()
            time.sleep(0.15)
    finally:
        keeper.stop()
    written = sorted(int(p.name[len("step-"):]) for p in root.glob("step-*") if (p / "rank-00000.pt").exists())
    assert written and all(step % 2 == 0 and step < 1000 for step in written), written
    assert same(torch.load(root / f"step-{written[-1]:08d}" / "rank-00000.pt"), states(written[-1]))


def test_persisted_files_load_with_torch_and_get_a_manifest_once_every_rank_is_there(tmp_path):
    root = tmp_path / "ckpt"
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    for step in (4, 8, 12):
        for rank in (0, 1):
            write = TorchSnapshotWriter(str(snaps), rank, 2, True, every=1, limit=0, copies=2)
            write.write(step, states(10 * step + rank))
            write.wait()
            record = persist({"source": write.paths[0] if read_header(write.paths[0]).step == step else write.paths[1],
                              "step": step, "rank": rank, "folder": str(root), "keep": 2})
            assert record["manifest"] == (rank == 1)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000008", "step-00000012"]
    manifest = json.loads((root / "step-00000012" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and [r["path"] for r in manifest["ranks"]] == [
        "step-00000012/rank-00000.pt", "step-00000012/rank-00001.pt"]
    assert same(torch.load(root / "step-00000012" / "rank-00001.pt"), states(121))
    disk = HeldSnapshot(1, 12, 2, True, DISK, str(root / "step-00000012" / "rank-00001.pt"),
                        manifest["ranks"][1]["nbytes"], manifest["ranks"][1]["crc32"])
    source = choose_restore(1, [inventory(0, disk, held(0, 12, DISK, world=2))], 2, {}).source_of(1)
    assert same(load_source(source, 12, str(snaps), Signer()), states(121))
    (root / "step-00000012" / "rank-00001.pt").write_bytes(b"damaged")
    with pytest.raises(SnapshotError, match="fails its checksum"):
        load_source(source, 12, str(snaps), Signer())


def test_a_snapshot_hands_the_tensors_its_staging_takes_to_it_and_copies_the_rest_itself(tmp_path):
    """GPU tensors reach the file through DeviceStaging (a CUDA stream of its own); on CPU a stand-in
    staging takes the float64 tensors and copies them as the real one does, into the views it is given."""

    class Staging:
        def __init__(self):
            self.ready, self.given = 0, []

        def takes(self, tensor):
            return tensor.dtype == torch.float64

        def mark_ready(self, tensors):
            self.ready += 1

        def copy(self, pairs):
            for target, tensor in pairs:
                self.given.append(tensor)
                target.view(tensor.dtype).view(tensor.shape).copy_(tensor)

    staging = Staging()
    writer = TorchSnapshotWriter(str(tmp_path), 0, 1, False, every=1, limit=0, copies=1, staging=staging)
    state = {"weights": torch.arange(6, dtype=torch.float64).reshape(2, 3), "step": torch.tensor([7]),
             "buffer": torch.ones(4, dtype=torch.float32)}
    writer.write(1, state, behind=frozenset({state["weights"].data_ptr()}))
    writer.wait_copied()
    writer.wait()
    saved = load_own(str(tmp_path), 0, 1)
    assert staging.ready == 1 and [t.data_ptr() for t in staging.given] == [state["weights"].data_ptr()]
    assert all(torch.equal(saved[k], v) for k, v in state.items())


def test_gpu_tensors_are_copied_plainly_on_the_training_stream_unless_told_otherwise():
    """The default of the three ways staging.py measured (least added to the next step on an H200);
    pinned buffers need a stream of their own. A CPU tensor is never staged."""
    from ftrun.snapshots.staging import DeviceStaging

    assert not DeviceStaging().own_stream and DeviceStaging(own_stream=True).own_stream
    assert DeviceStaging(pinned=True).own_stream
    assert not DeviceStaging(own_stream=True).takes(torch.ones(2))
