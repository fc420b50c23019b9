"""The step protocol (``start_steps``, ``begin_step``, ``end_step -> StepOutcome``) of both worker libraries, and
``guard()`` and ``steps()`` built on it, over fakes of the training state, the control link and the repair: how
each way a step can end is answered, and what the job did to get there."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from ftrun.elastic.job import ElasticJob, StepGuard
from ftrun.mindspore_elastic.job import MindSporeJob
from ftrun.steps import Ending, StepOutcome
from tests.conftest import ROOT
from tests.unit.test_contract import imported_modules

#: the step a fake job is at as a step begins, and the one its fake repair rolls back to
AT, CONSISTENT = 5, 3


class FakeState:
    """What the job asks of ``TrainingState`` around a step."""

    def __init__(self, calls: list[str]):
        self.calls = calls
        self.step = AT
        self.needs_state = False
        self.snapshots = None

    def start_at(self, step: int) -> None:
        self.step = step

    def begin_step(self) -> None:
        self.calls.append("state.begin_step")

    def commit(self) -> None:
        self.calls.append("commit")
        self.step += 1

    def mark_mutated(self) -> None:
        self.calls.append("mark_mutated")

    def restore_buffers(self) -> None:
        self.calls.append("restore_buffers")


class FakeLink:
    """The control link: a collective's failure recorded in the step (``failure``), and the generation the
    controller announces for an error (``target``; None: no repair comes, the error is the rank's own)."""

    repairs = True

    def __init__(self, calls: list[str], failure: BaseException | None, target: int | None):
        self.calls, self.failure, self.target = calls, failure, target

    def step_begins(self) -> None:
        self.calls.append("link.step_begins")

    def step_ends(self) -> BaseException | None:
        self.calls.append("link.step_ends")
        return self.failure

    def repair_target(self, error: BaseException, step: int) -> int | None:
        self.calls.append(f"repair_target({type(error).__name__})")
        return self.target

    def first_step_committed(self) -> None:
        self.calls.append("first_step_committed")


class FakeRepair:
    """The rank's repair: it rolls the state back to the consistent step."""

    def __init__(self, state: FakeState, calls: list[str]):
        self.state, self.calls = state, calls

    def recover(self, target: int) -> None:
        self.calls.append(f"recover({target})")
        self.state.step = CONSISTENT


def fake_job(failure: BaseException | None = None, target: int | None = None, start: int = AT) -> ElasticJob:
    """An ``ElasticJob`` as ``__init__`` leaves it under ftrun (its layout settled), on fakes; its steps started
    at ``start``. ``job.calls`` lists what it did to the fakes."""
    job = ElasticJob.__new__(ElasticJob)
    job.calls = []
    job.state = FakeState(job.calls)
    job.link = FakeLink(job.calls, failure, target)
    job.repair = FakeRepair(job.state, job.calls)
    job._started, job._part_mesh, job._began, job._told, job._open, job._ends = True, None, None, False, False, 0
    job._guard = StepGuard(job)
    job.start_steps(total=10, start=start)
    return job


OWN = ValueError("the rank's own")
PEER = RuntimeError("a peer is gone")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    begun: bool  # begin_step() came first
    error: BaseException | None  # what the body raised
    failure: BaseException | None  # a collective of the step failed, recorded (the body finished)
    target: int | None  # the generation the controller announces; None: no repair
    ending: Ending
    step: int  # the outcome's step
    lost: BaseException | None  # the outcome's error
    calls: tuple[str, ...]  # what the job did, after begin_step's calls


CASES = [
    Case("a finished body commits", True, None, None, None, Ending.COMMITTED, AT + 1, None,
         ("link.step_ends", "commit", "first_step_committed")),
    Case("a peer lost in the body repairs to the consistent step", True, PEER, None, 1, Ending.REPAIRED, CONSISTENT,
         None, ("link.step_ends", "repair_target(RuntimeError)", "restore_buffers", "recover(1)")),
    Case("the rank's own error is lost", True, OWN, None, None, Ending.LOST, AT, OWN,
         ("link.step_ends", "repair_target(ValueError)")),
    Case("a finished body whose collective failed repairs", True, None, PEER, 2, Ending.REPAIRED, CONSISTENT, None,
         ("link.step_ends", "mark_mutated", "repair_target(RuntimeError)", "restore_buffers", "recover(2)")),
    Case("a finished body whose collective failed with no repair is lost with the failure", True, None, PEER, None,
         Ending.LOST, AT, PEER, ("link.step_ends", "mark_mutated", "repair_target(RuntimeError)")),
    Case("a body run outside the protocol commits", False, None, None, None, Ending.COMMITTED, AT + 1, None,
         ("commit", "first_step_committed")),
    Case("an error between steps repairs, its step committed already", False, PEER, None, 1, Ending.REPAIRED,
         CONSISTENT, None, ("repair_target(RuntimeError)", "recover(1)")),
    Case("an error between steps with no repair is lost", False, OWN, None, None, Ending.LOST, AT, OWN,
         ("repair_target(ValueError)",)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_end_step_answers_how_the_step_ended(case: Case):
    job = fake_job(case.failure, case.target)
    if case.begun:
        job.begin_step()
        assert job.calls == ["state.begin_step", "link.step_begins"]
        job.calls.clear()
    outcome = job.end_step(case.error)
    assert outcome == StepOutcome(case.ending, case.step, case.lost)
    assert outcome.error is case.lost
    assert tuple(job.calls) == case.calls


def test_the_first_commit_is_told_once():
    job = fake_job()
    for _ in range(3):
        job.begin_step()
        assert job.end_step().committed
    assert job.calls.count("first_step_committed") == 1 and job.step == AT + 3


def test_a_step_repaired_back_to_where_the_steps_began_is_no_first_commit():
    job = fake_job(PEER, target=1, start=CONSISTENT)
    job.begin_step()
    assert job.end_step(PEER).repaired and "first_step_committed" not in job.calls


def test_begin_step_before_the_steps_start_is_refused_under_ftrun():
    job = fake_job()
    job._began = None
    with pytest.raises(RuntimeError, match="before start_steps"):
        job.begin_step()


# -- steps() and guard(), built on the protocol ---------------------------------------------------------------


def test_a_loop_without_guard_commits_each_step():
    job = fake_job(start=0)
    assert list(job.steps(3)) == [0, 1, 2]
    assert job.calls.count("commit") == 3 and "link.step_begins" not in job.calls


def test_the_guard_leaves_the_repair_to_the_loop_so_the_code_after_the_block_sees_the_step_as_it_ended():
    job = fake_job(target=1, start=AT)
    seen: list[tuple[int, int]] = []
    raised: list[int] = []
    for step in job.steps(AT + 2, start=AT):
        with job.guard():
            if step == AT and not raised:
                raised.append(step)
                raise PEER
        seen.append((step, job.step))  # job.step == step + 1: committed
    # the lost step: job.step still AT after the block; the loop then went on from the consistent step
    assert seen[0] == (AT, AT) and seen[1] == (CONSISTENT, CONSISTENT + 1)
    assert job.calls.index("recover(1)") > job.calls.index("restore_buffers")
    assert [s for s, _ in seen] == [AT, *range(CONSISTENT, AT + 2)]


def test_the_guard_raises_a_failed_collective_of_a_finished_body_when_no_repair_comes():
    job = fake_job(failure=PEER, target=None, start=0)
    with pytest.raises(RuntimeError, match="a peer is gone"):
        for _ in job.steps(3):
            with job.guard():
                pass
    assert "commit" not in job.calls


def test_the_guard_lets_the_rank_s_own_error_through():
    job = fake_job(start=0)
    with pytest.raises(ValueError):
        for _ in job.steps(3):
            with job.guard():
                raise OWN
    assert "recover" not in " ".join(job.calls) and job.step == 0


def test_a_body_that_drives_the_protocol_itself_is_not_committed_twice():
    job = fake_job(start=0)
    for _ in job.steps(2):
        job.begin_step()
        job.end_step()
    assert job.calls.count("commit") == 2


# -- MindSpore's job ---------------------------------------------------------------------------------------------


class FakeMindSporeRepair:
    def __init__(self, target: int | None):
        self.target, self.in_step, self.recovered, self.committed = target, False, [], 0

    def target_after(self, error: BaseException) -> int | None:
        return self.target if isinstance(error, RuntimeError) else None

    def recover(self, target: int) -> None:
        self.recovered.append(target)

    def step_committed(self) -> None:
        self.committed += 1


MS_CASES = [
    ("a finished body commits", None, None, Ending.COMMITTED, 1, []),
    ("a fault elsewhere repairs", PEER, 3, Ending.REPAIRED, 0, [3]),
    ("the rank's own error is lost", OWN, 3, Ending.LOST, 0, []),
    ("no repair announced: lost", PEER, None, Ending.LOST, 0, []),
]


@pytest.mark.parametrize("error, target, ending, step, recovered", [c[1:] for c in MS_CASES],
                         ids=[c[0] for c in MS_CASES])
def test_a_mindspore_step_ends_as_a_torch_one(error, target, ending, step, recovered):
    job = MindSporeJob()
    job.repair = repair = FakeMindSporeRepair(target)
    job.begin_step()
    assert repair.in_step
    outcome = job.end_step(error)
    assert (outcome.ending, outcome.step, repair.recovered, repair.in_step) == (ending, step, recovered, False)
    assert repair.committed == step  # MindSpore's step-end work (the flags) only for a committed step
    assert outcome.error is (error if ending is Ending.LOST else None)


def test_a_mindspore_job_outside_process_level_loses_every_error():
    job = MindSporeJob()  # outside ftrun: no repair
    job.begin_step()
    assert job.end_step(PEER).lost and job.end_step().committed and job.step == 1


def test_the_outcome_s_module_imports_the_standard_library_alone():
    """Both worker libraries import it, and MindSpore's python has no torch."""
    imported = imported_modules(ROOT / "ftrun" / "steps.py")
    assert imported, "no import found: the check reads the wrong file"
    outside = sorted(name for name in imported if name not in sys.stdlib_module_names and name != "__future__")
    assert not outside, f"ftrun/steps.py imports {', '.join(outside)}: it may depend on the standard library only"
