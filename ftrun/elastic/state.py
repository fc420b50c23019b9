"""The training state one rank commits, snapshots, sends and restores.

It holds the objects the script registered, the DDP wrappers, the number of steps committed and
whether this rank's copy of the state is whole: a replacement has none until a peer sends it, and a
step lost after the optimizer's ``step()`` leaves it half applied. The repair reads it through
:attr:`TrainingState.committed` and puts it back with :meth:`TrainingState.load` and
:meth:`TrainingState.resume_at`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable

import torch

from ftrun.auth import Signer
from ftrun.elastic.arrays import TorchSnapshotWriter, load_first_good, sources_to_restore
from ftrun.elastic.ddp import ElasticDDP
from ftrun.elastic.groups import GroupFailed, first_line
from ftrun.elastic.layout import ReplicaLayout
from ftrun.elastic.shards import load_local, local_tensor, to_local
from ftrun.errors import WORKER_SETTING_EXIT
from ftrun.snapshots.format import SnapshotTooLarge
from ftrun.snapshots.plan import RestorePlan, RestoreSource

log = logging.getLogger("ftrun.elastic")


class TrainingState:
    """One rank's training state: the registered objects, its step, and whether it holds them whole."""

    def __init__(self, layout: ReplicaLayout, snapshots: TorchSnapshotWriter | None = None, overlap: bool = True,
                 rank: int = 0, needs_state: bool = False,
                 lost_collective: Callable[[], BaseException | None] = lambda: None):
        #: the objects the script registered, by name
        self.objects: dict[str, Any] = {}
        #: the script's ElasticDDP wrappers
        self.wrappers: list[ElasticDDP] = []
        #: which ranks hold copies of this state (settled at the first steps())
        self.layout = layout
        #: this rank's snapshots into its agent's memory (--snapshot-every), or None
        self.snapshots = snapshots
        #: copy the parameters and the optimizer's state into a snapshot while the next step's forward
        #: and backward run (the optimizer's step waits for the copy)
        self.overlap = overlap
        self.rank = rank
        #: the failure of a collective of this step, if one failed (a peer died): the optimizer must not
        #: apply gradients that were not averaged
        self._lost_collective = lost_collective
        self._step = 0
        #: a replacement rank, until a peer sent it the state
        self._needs_state = needs_state
        #: the optimizer's step ran in the step under way: an interrupted step leaves the state half applied
        self._mutated = False
        #: the modules' buffers as the step began
        self._saved_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    # -- what the script registers ----------------------------------------------------------------------

    def register(self, name: str, obj) -> None:
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{name}: {type(obj).__name__} has no state_dict()/load_state_dict()")
        self.objects[name] = obj
        if isinstance(obj, torch.optim.Optimizer):
            obj.register_step_pre_hook(self._on_optimizer_step)

    def add_wrapper(self, wrapper: ElasticDDP) -> None:
        self.wrappers.append(wrapper)

    # -- where it stands ------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The next step to run: the number of steps committed so far."""
        return self._step

    @property
    def needs_state(self) -> bool:
        """True in a replacement rank until a peer sent it the state."""
        return self._needs_state

    @property
    def committed(self) -> int | None:
        """The step this rank holds the whole state of; None when it holds none (a replacement) or a step
        interrupted after the optimizer's step left it half applied."""
        return None if (self._needs_state or self._mutated) else self._step

    def adopt(self, layout: ReplicaLayout) -> None:
        """Go by ``layout`` from now on: where some rank has no copy, its snapshots are its own."""
        self.layout = layout
        if self.snapshots is not None:
            self.snapshots.sharded = len(layout.replica_sets()) > 1

    def start_at(self, step: int) -> None:
        """A fresh job begins at ``step`` (the script's own checkpoint), unless it is past it already."""
        if self._step < step:
            self._step = step

    # -- a step -------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        self._mutated = False
        # buffers as the step begins (cheap: running statistics are small), put back if it is lost
        modules = {id(m): m for m in (*self.objects.values(), *self.wrappers) if isinstance(m, torch.nn.Module)}
        self._saved_buffers = [(b, b.detach().clone()) for m in modules.values() for b in m.buffers()]

    def restore_buffers(self) -> None:
        """Undo what the forward of an interrupted step did to the buffers."""
        for buffer, saved in self._saved_buffers:
            buffer.data.copy_(saved)

    def mark_mutated(self) -> None:
        """What the step changed is unknown (a collective failed, yet the body finished)."""
        self._mutated = True

    def _on_optimizer_step(self, *args) -> None:
        self.before_update()

    def before_update(self) -> None:
        """The state is about to change (a registered optimizer's step, or one a framework runs): not with
        gradients a failed collective left unaveraged (GroupFailed), nor under a snapshot still copying it."""
        failure = self._lost_collective()
        if failure is not None:  # its gradients are not averaged
            raise GroupFailed(f"rank {self.rank}: step {self._step} lost a collective ({first_line(failure)})")
        if self.snapshots is not None:
            self.snapshots.wait_copied()  # the snapshot's copy of what this step changes is done
        self._mutated = True

    def commit(self) -> None:
        self._step += 1
        self._mutated = False
        if self.snapshots is not None and self.snapshots.due(self._step):
            behind = self._optimized() if self.overlap else frozenset()
            try:
                self.snapshots.write(self._step, self.states(), behind)
            except SnapshotTooLarge as e:  # any restart would fail the same way: say so, and say not to retry
                print(f"ftrun.elastic: {e}", file=sys.stderr, flush=True)
                os._exit(WORKER_SETTING_EXIT)

    def _optimized(self) -> frozenset[int]:
        """The tensors only a registered optimizer's step changes: its parameters and its state."""
        found: set[int] = set()
        for obj in self.objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                found.update(local_tensor(p).data_ptr() for group in obj.param_groups for p in group["params"])
                found.update(local_tensor(v).data_ptr() for state in obj.state.values() for v in state.values()
                             if isinstance(v, torch.Tensor))
        return frozenset(found)

    # -- out and back in ------------------------------------------------------------------------------

    def states(self) -> dict:
        """Every registered object's state, each DTensor as this rank's local shard (shards.py)."""
        return to_local({name: obj.state_dict() for name, obj in self.objects.items()})

    def load(self, states: dict) -> None:
        if self.snapshots is not None:
            self.snapshots.wait()  # no snapshot may still be reading what this overwrites
        for name, obj in self.objects.items():
            load_local(obj, states[name])

    def reset_wrappers(self) -> None:
        """Every rank now holds the same parameters (its replica set's): the wrappers start their step anew."""
        for wrapper in self.wrappers:
            wrapper.reset(synced=True)

    def resume_at(self, step: int) -> None:
        """The repair's rollback is over: this rank holds the whole state of ``step`` and trains on from it."""
        for obj in self.objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)
        self.reset_wrappers()
        self._step = step
        self._needs_state = False
        self._mutated = False
        if self.snapshots is not None:
            self.snapshots.resume_at(step)

    def restore(self, plan: RestorePlan | None, start: int, generation: int, signer: Signer,
                report_damaged: Callable[[RestoreSource], None]) -> bool:
        """After a job-level restart: load the state the controller's restore ``plan`` names for this rank
        (from this node's memory, a peer's replica or the checkpoint folder); True when it did."""
        sources = sources_to_restore(plan, self.rank, start, generation)
        if not sources:
            return False
        began = time.monotonic()
        source, state = load_first_good(sources, plan.step, self.snapshots.folder, signer, report_damaged)
        self.load(state)
        self.reset_wrappers()  # every rank loaded the same step
        self._step = plan.step
        self.snapshots.resume_at(plan.step)
        log.warning("rank %d: restored step %d from %s on node %d in %.2fs", self.rank, plan.step, source.where,
                    source.node_rank, time.monotonic() - began)
        return True
