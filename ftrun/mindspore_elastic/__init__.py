"""ftrun.mindspore_elastic: snapshots of a MindSpore rank's parameters and optimizer state, so that a
job-level restart resumes from the newest step every rank holds instead of the script's last checkpoint.

Add a few lines to an msrun script run with ``ftrun --framework mindspore --snapshot-every K``::

    import ftrun.mindspore_elastic

    init()                                              # mindspore.communication.init(), as before
    job = ftrun.mindspore_elastic.init()
    job.register(network=net, optimizer=optimizer)      # the Cells whose Parameters are the training state
    for step in job.steps(total_steps):                 # the step number is the data position
        loss = train_step(*batch_for(step))

Every K steps each rank copies its registered Parameters (``asnumpy()``) into its agent's shared memory;
the agent replicates them to peer nodes and, with ``--checkpoint-dir``, has them written as ``.ckpt``
files that ``mindspore.load_checkpoint`` reads. After a fault the job restarts at job level (MindSpore
cannot re-form its communication in a running process on the CPU build), and ``steps()`` of the new
generation first puts back the state of the newest step every rank holds (``Parameter.set_data``) and
goes on from there: at most K steps are redone. ``Model.train`` users pass :meth:`MindSporeJob.callback`.

With ``--recovery process`` on Ascend, put the step's body in ``with job.guard():``: a fault elsewhere is
repaired in place through MindSpore's own hooks, and a replacement receives the parameters from a healthy
replica (``ftrun/mindspore_elastic/repair.py``). Build the optimizer with MindSpore's fault-tolerant wrapper
(``TrainFaultTolerance.get_optimizer_wrapper``) and register it: its flag tells whether a rank stopped in
the middle of its step can still give its state (docs/mindspore.md).

Outside ftrun, or without ``--snapshot-every``, ``steps()`` simply counts. This package imports neither
torch (a MindSpore python has none) nor anything of the launcher; mindspore and numpy are imported by the
functions that need them.

Its files mirror ``ftrun/elastic/``'s, one for one: ``job.py`` (the job a script holds, ``MindSporeJob``),
``snapshots.py`` (a rank's arrays in ftrun's snapshots), ``link.py`` (the rank's line to its agent: the
relay folder's ``RepairChannel``, where a torch rank's ``ControlLink`` reads the control store),
``backends.py`` (the device and communication seam: MindSpore's own hooks on Ascend), ``repair.py`` (the
rank's part in a process-level repair). What is framework-free is shared with ``ftrun.elastic``:
``ftrun/rollback.py`` (the consistent step) and ``ftrun/repair_loop.py`` (the repair's outer loop).
"""

from __future__ import annotations

from ftrun.mindspore_elastic.arrays import MindSporeArrays
from ftrun.mindspore_elastic.job import MindSporeJob, read_plan


def init(sharded: bool = False) -> MindSporeJob:
    """This rank's job, after ``mindspore.communication.init()``. ``sharded=True``: every rank holds its
    own part of the state (model parallelism), so each restores its own snapshot rather than any rank's."""
    return MindSporeJob(sharded)


__all__ = ["init", "MindSporeJob", "MindSporeArrays", "read_plan"]
