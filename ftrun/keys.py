"""Every store key ftrun uses, built in one place.

All keys of a job live under ``ftrun/<run_id>/``. The control sequences
(commands, reports) only grow: nothing is ever overwritten, and every message
names its generation. Keys of a generation live under ``ftrun/<run_id>/g<g>/``
and are never reused: the worker library forms each generation's process group
there, and scripts that use plain env:// get a fresh worker store per generation
(``ftrun.store.start_worker_store``). torchrun's restarted workers hang on
stale keys (pytorch issues 135712 and 167288); ftrun's cannot see any.

What each message path costs, for N nodes of P ranks (W = N x P), in store round trips (scripts/
bench_control_plane.py measures them; docs/scale.md). A ``multi_set`` of many keys goes in messages of
at most 64 keys and 64 kB, a ``multi_get`` in requests of at most 1,024 keys: the store's server takes
time that grows with the square of a message's keys (``ftrun.store.MULTI_SET_KEYS``).

* rendezvous: each agent appends one ``join`` record (O(1)) and its Watch blocks in the store's
  ``get`` of its own ``doorbell``; the controller reads the new records at each poll (O(N) in all),
  then writes each agent's ``rendezvous_place`` (O(1) bytes: its slot and the job's size), the
  outcome, and every joined agent's bell, rung with its own place's text, in one ``multi_set``: O(N)
  bytes in all. Each agent's Watch wakes holding its place: no round trip, O(1) bytes per agent. (A
  result naming every node, read by every agent, was O(N^2) bytes: 133 MB at 1,024 nodes.)
* keepalives: every 0.5 s each agent reads in one ``multi_get`` the controller's counter, the
  command count and its P ranks' heartbeats and steps (the hang check), and sets its
  ``node_heartbeat`` to its own count in one ``multi_set`` that also carries its ``agent_status``
  (O(P) bytes: its ranks' pids, liveness, steps and heartbeat ages) when the board is next rebuilt
  (``board_interval``) or the node changed: 2 round trips per agent, O(N)/s in all, and O(W) status
  bytes per board period. The controller reads all N keepalive counters in one ``multi_get`` per
  0.5 s: O(1) round trips, O(N) bytes.
* rank heartbeats: each rank adds to ``rank_heartbeat`` and sets ``rank_progress``, ``rank_step_times`` and
  ``rank_collective`` (the three in one ``multi_set``) every second (the worker library: O(W) writes/s
  job-wide). Only its own agent reads them; the controller never reads a key per rank.
* status board: the controller reads the N statuses in two round trips (``check``, ``multi_get``) and
  writes ``status``: O(W) bytes, rebuilt once per ``board_interval`` (at most BOARD_RANKS_PER_S ranks'
  worth a second).
* reports: an agent appends one (O(1): two round trips); the controller polls ``report_count`` (O(1)
  per tick).
* failed collectives (the online level): a rank whose collective fails while it lives writes one
  ``collective_failure`` (a ``compare_set``: the first rank's stays), from its heartbeat's connection; the
  controller reads that one key per tick while the generation runs at process level (O(1)).
* STOP acknowledgements: each agent sets its own ``stopped`` key once its workers are gone (one round
  trip, O(N) in all, none of them in the sequence of reports); while it waits for them the controller
  checks the keys of the nodes it waits for in one ``check`` per tick (O(N) bytes), and reads them in one
  ``multi_get`` once all are there (O(N) bytes, one decision for every node instead of N).
* commands: the controller appends a decision's commands, whatever N (broadcast keys, never one per
  node), and rings every agent's ``doorbell`` once with their texts, the commands and the bells in one
  ``multi_set`` (O(N) bytes, two round trips with the indices' reservation); each agent's Watch,
  blocked in a ``get`` of its bell, wakes holding the commands and asks for the next bell: one round
  trip per agent and decision (a lost node's takeover and STOP ring once). Idle
  agents poll nothing: the command count in the keepalive read is only a net under the bell.
* repair announcements (process level): the controller sets ``target_generation`` and every rank's
  ``announced`` key in one ``multi_set`` (O(W) bytes, O(1) round trips); each rank's repair watch,
  blocked in a ``wait`` on its own key, wakes: one round trip per rank and repair.
* layout and rank tables: the controller writes a ``layout`` of O(N) bytes, its ``layout_change``
  from the version before and the ``layout_version`` in one ``multi_set`` whenever a node's place
  changes (a takeover, a resize; not at a restart of the same nodes). Every command says the
  layout's version: an agent that holds it asks nothing at a START or REPLACE; one that does not
  reads the version (one round trip) and only the changes since the layout it holds (two: O(1) bytes
  for a takeover, O(N) for a resize, which renumbers the ranks). The whole layout is read once per
  agent, at its first START: each agent's rank tables name every rank, so that is O(N) bytes per
  agent and O(N^2) from the store in all, once per job (docs/scale.md: what would carry it at
  10,000 nodes). Each agent writes a rank table of O(W) entries locally.
* restore plan: one ``restore_plan`` per node, written in one ``multi_set``: O(P x (1 + R)) entries for
  sharded state (R replicas), O(P + REPLICATED_SPARES) for replicated state; O(W x (1 + R)) in all,
  chosen and written in O(W x (1 + R)) time. Each rank reads its own node's plan once: O(P) bytes,
  where a plan for the whole job would have cost every rank O(W) (O(W^2) bytes through the store).
* etcd (``--rdzv-backend etcd``: ``controller/leadership.py``, ``controller/journal.py``; its keys are
  ``EtcdKeys``): in steady state only the leader writes, one lease renewal every ``--node-timeout / 3``
  s whatever N (a 3 s lease: 1 a second, 1/N per node per second: 0.001 at 1,024 nodes); the other
  agents neither write nor watch until the control store goes. Each decision writes, in one
  transaction, only the journal's parts it changed: its own part, O(1) bytes (about 850 at 8 to 1,024
  nodes); the roster, O(N), at a takeover or a resize; the rendezvous result, O(N), once per
  controller (262 kB in all at 1,024 nodes). A successor reads the parts in one range read.
"""

from __future__ import annotations

from dataclasses import dataclass

#: how often (seconds) each agent sends its keepalive (its ``node_heartbeat``, with its node's status) and
#: reads the controller's; the controller reads the agents' keepalives and beats its own at the same pace
AGENT_HEARTBEAT_INTERVAL = 0.5
#: the status board costs O(ranks) to build, serialise and write: a big job's is rebuilt at most this many
#: ranks' worth a second (a job of up to 2,048 ranks: at every keepalive), and at once when the phase or
#: the generation changes, so that the controller's steady CPU does not grow with the job
BOARD_RANKS_PER_S = 4096


def board_interval(world_size: int, keepalive: float) -> float:
    """Seconds between two rebuilds of the status board; each agent writes its node's status (what
    the board is built from) as often, and at once when the node changed."""
    return max(keepalive, world_size / BOARD_RANKS_PER_S)


@dataclass(frozen=True)
class JobKeys:
    """The keys of one job, by run id."""

    run_id: str

    @property
    def root(self) -> str:
        return f"ftrun/{self.run_id}"

    # rendezvous: agents append join records; the controller publishes the result
    @property
    def arrivals(self) -> str:
        return f"{self.root}/rdzv/arrivals"

    def join(self, index: int) -> str:
        return f"{self.root}/rdzv/join/{index}"

    @property
    def rendezvous_result(self) -> str:
        """The rendezvous's outcome for an agent with no place of its own (a Placement without a slot:
        the job's size, or why the rendezvous failed), written after every agent's place."""
        return f"{self.root}/rdzv/result"

    def rendezvous_place(self, agent_id: str) -> str:
        """The agent's own Placement (its doorbell rings with the same sealed text)."""
        return f"{self.root}/rdzv/place/{agent_id}"

    def preflight_plan(self, agent_id: str) -> str:
        """--preflight: the agent's turns in the data network's bandwidth check (a PairPlan)."""
        return f"{self.root}/rdzv/pairs/plan/{agent_id}"

    def preflight_pairs(self, agent_id: str) -> str:
        """--preflight: what the agent measured of its turns (a PairReport)."""
        return f"{self.root}/rdzv/pairs/report/{agent_id}"

    @property
    def rendezvous_readers(self) -> str:
        """Counter of agents that read the result: a failed rendezvous keeps the store up until all did."""
        return f"{self.root}/rdzv/readers"

    # liveness counters: a reader notices progress with its own clock, so hosts need no clock sync
    @property
    def controller_heartbeat(self) -> str:
        return f"{self.root}/ctl/heartbeat"

    def node_heartbeat(self, node_rank: int) -> str:
        return f"{self.root}/node/{node_rank}/heartbeat"

    @property
    def layout(self) -> str:
        """The nodes as they are now (a NodeLayout): which agent holds each node rank, after any takeover or
        resize; the rank tables are built from it. An agent reads it whole once, then its changes."""
        return f"{self.root}/layout"

    @property
    def layout_version(self) -> str:
        """The version of the newest layout, as text, written after the layout and its change. Unsigned,
        like the counters: a forged one makes an agent read the (signed) layout whole, or a change late."""
        return f"{self.root}/layout/version"

    def layout_change(self, version: int) -> str:
        """The NodeLayoutChange from version ``version`` - 1 to ``version``."""
        return f"{self.root}/layout/change/{version}"

    def agent_status(self, agent_id: str) -> str:
        """The agent's NodeStatus (ranks, standbys, devices), rewritten at each keepalive."""
        return f"{self.root}/agent/{agent_id}/status"

    @property
    def status(self) -> str:
        """The controller's status snapshot (JSON), rewritten while the job runs: ``ftrun status`` reads it."""
        return f"{self.root}/status"

    @property
    def status_final(self) -> str:
        """Set once the job has decided to end, after its last status: a watcher waits on it between reads,
        so it wakes for the end before the store goes with the job."""
        return f"{self.root}/status/final"

    def spare_heartbeat(self, agent_id: str) -> str:
        return f"{self.root}/spare/{agent_id}/heartbeat"

    @property
    def spares_left(self) -> str:
        """Counter of idle spares that read the job's EXIT: the store's host waits for them before it goes."""
        return f"{self.root}/spare/left"

    def admission(self, agent_id: str) -> str:
        """The controller's answer to an agent that joined after the rendezvous: "spare", or why not."""
        return f"{self.root}/spare/{agent_id}/admission"

    # commands: controller -> agents, an append-only sequence
    @property
    def command_count(self) -> str:
        return f"{self.root}/cmd/count"

    def command(self, seq: int) -> str:
        return f"{self.root}/cmd/{seq}"

    # reports: agents -> controller, an append-only sequence
    @property
    def report_count(self) -> str:
        return f"{self.root}/report/count"

    def report(self, seq: int) -> str:
        return f"{self.root}/report/{seq}"

    def stopped(self, generation: int, agent_id: str) -> str:
        """The agent's acknowledgement of generation ``generation``'s STOP (a signed STOPPED Report): no
        worker of the generation is left on its node. Not a report in the sequence: one write per
        agent, and the controller checks every node's in one request."""
        return f"{self.generation(generation)}/stopped_by/{agent_id}"

    # process-level recovery: the generation the workers must be in, and each generation's own keys
    @property
    def target_generation(self) -> str:
        return f"{self.root}/target_generation"

    def generation(self, generation: int) -> str:
        """The prefix of generation ``generation``'s worker-library keys (never reused)."""
        return f"{self.root}/g{generation}"

    def process_group(self, generation: int) -> str:
        """PrefixStore prefix under which generation ``generation`` connects its process groups (each
        group of the script under its own torch name below it)."""
        return f"{self.generation(generation)}/pg"

    def milestone(self, generation: int, name: str) -> str:
        """Counter of ranks that reached a milestone: stopped, arrived, joined (the group formed
        under ftrun.elastic: the controller's sign that process level is possible), resumed."""
        return f"{self.generation(generation)}/{name}"

    def announced(self, generation: int, rank: int) -> str:
        """Set for each rank when the controller announces a process-level repair into this generation
        (all in one ``multi_set``): a key per rank, so that a rank that ends can ring its own to let its
        repair watch out of the store's wait, and no other rank takes that for a repair."""
        return f"{self.generation(generation)}/announced/{rank}"

    def replaced(self, generation: int) -> str:
        """The ranks a process-level repair into this generation starts again (comma-separated, set before it is
        announced): a rank of one of them that is not its replacement (a frozen node's, woken after the spare
        took its place) leaves rather than join."""
        return f"{self.generation(generation)}/replaced"

    def group_ready(self, generation: int) -> str:
        """Set once every rank arrived to form the generation's group, or once it is superseded."""
        return f"{self.generation(generation)}/group_ready"

    def data_probe(self, probe_id: int) -> str:
        """Where the agent of probe id ``probe_id`` (a node rank, or a spare's id below zero) answers the data
        network's probe (``HOST:PORT`` on its data address, ``ftrun.detection.reach``); its peers read it once a
        probe round."""
        if probe_id < 0:
            return f"{self.root}/spare/{-probe_id}/data_probe"
        return f"{self.root}/node/{probe_id}/data_probe"

    @property
    def spare_probes(self) -> str:
        """A counter: how many spares took a probe id (each adds one, and its id is minus the count it got)."""
        return f"{self.root}/spare_probes"

    def rank_heartbeat(self, rank: int) -> str:
        return f"{self.root}/rank/{rank}/heartbeat"

    def rank_progress(self, rank: int) -> str:
        """The rank's last committed step, as text."""
        return f"{self.root}/rank/{rank}/step"

    def rank_step_times(self, rank: int) -> str:
        """The rank's recent step, compute and wait times (``ftrun.step_times.StepTimes`` as text), written with
        its heartbeat; its agent forwards them in the node's status (stragglers)."""
        return f"{self.root}/rank/{rank}/times"

    def rank_collective(self, rank: int) -> str:
        """The collective the rank waits in now, or none (``ftrun.step_times.collective_text``), written with its
        heartbeat; its agent forwards it in the node's status (a stall says which ranks wait in which)."""
        return f"{self.root}/rank/{rank}/collective"

    @property
    def total_steps(self) -> str:
        """The number of steps the script will run, as text, when it knows (the worker library sets it
        from ``job.steps(total)``): the status view's progress bar and ETA."""
        return f"{self.root}/total_steps"

    def snapshot_inventory(self, agent_id: str) -> str:
        """The agent's SnapshotInventory: what copies of the ranks' state its node holds, and where it serves them."""
        return f"{self.root}/snapshots/{agent_id}"

    def restore_plan(self, generation: int, node_rank: int) -> str:
        """The controller's RestorePlan for a node's ranks, in a generation started by a job-level
        restart."""
        return f"{self.generation(generation)}/restore/{node_rank}"

    @property
    def damaged_count(self) -> str:
        """How many copies ranks found damaged while restoring (a sequence: ``damaged``)."""
        return f"{self.root}/snapshots/damaged/count"

    def damaged(self, index: int) -> str:
        """A RestoreSource that failed its check when a rank read it: later plans leave it out."""
        return f"{self.root}/snapshots/damaged/{index}"

    @property
    def etcd_unreachable(self) -> str:
        """--rdzv-backend etcd: why etcd does not answer the controller ("" while it does); each agent
        reads it with its keepalive's one round trip and says it once."""
        return f"{self.root}/etcd_unreachable"

    @property
    def process_level_refused(self) -> str:
        """Why the script's layout rules process-level repair out (set by rank 0 at its first steps(), or at
        the end of its first step for a mesh whose replicas that step shows; once per job)."""
        return f"{self.root}/process_level_refused"

    def rollback_failure(self, generation: int) -> str:
        """Why the generation's rollback could not happen (a RollbackFailure: no healthy replica holds the
        state), set by the ranks that found it; the controller falls back to job level once it reads it."""
        return f"{self.generation(generation)}/rollback_failure"

    def collective_failure(self, generation: int) -> str:
        """The first CollectiveFailure of the generation (a rank's collective failed, its process alive),
        set by the rank that saw it (one round trip; later ones leave the first in place); the controller
        reads it once a tick while the generation runs."""
        return f"{self.generation(generation)}/collective_failure"

    def online_repair(self, generation: int) -> str:
        """Set with the announcement of a repair that replaces no process (the online level): a MindSpore
        rank resumes its communicators instead of rebuilding them (``ftrun/mindspore_elastic/repair.py``)."""
        return f"{self.generation(generation)}/online_repair"

    # ftrun top: what an operator asks of the job, and what the view reads beyond the status
    @property
    def operator_count(self) -> str:
        return f"{self.root}/operator/count"

    def operator_request(self, seq: int) -> str:
        """An OperatorRequest (restart a rank, drain a node, stop the job), signed with the job's token:
        an append-only sequence that the controller reads."""
        return f"{self.root}/operator/{seq}"

    def doorbell(self, agent_id: str, ring: int | str) -> str:
        """Set when there is news for the agent: ring "rendezvous" once the rendezvous result is written,
        ring k once command k is. The agent's Watch blocks in the store's ``get`` of its next ring,
        and an agent that leaves rings its own next bell to let the watch go (ftrun.agent.protocol)."""
        return f"{self.root}/agent/{agent_id}/bell/{ring}"

    def stack_request(self, agent_id: str) -> str:
        """A StackRequest for one of the agent's ranks (signed like a command); the agent looks at each keepalive."""
        return f"{self.root}/agent/{agent_id}/stack_request"

    def rank_stack(self, rank: int) -> str:
        """The rank's Python stack as the agent dumped it on request (JSON: nonce, text)."""
        return f"{self.root}/rank/{rank}/stack"

    def agent_output(self, agent_id: str) -> str:
        """The last output lines of each of the agent's ranks (JSON), rewritten only when they changed."""
        return f"{self.root}/agent/{agent_id}/output"

    @property
    def rank_history(self) -> str:
        """The controller's short per-rank history of steps and heartbeat ages (JSON), every few seconds."""
        return f"{self.root}/status/history"

    @property
    def event_count(self) -> str:
        return f"{self.root}/events/count"

    def event_batch(self, index: int) -> str:
        """The events the controller logged since the previous batch (a JSON list): ``ftrun top``'s event log."""
        return f"{self.root}/events/{index}"


@dataclass(frozen=True)
class EtcdKeys:
    """The run's keys in etcd, under ``ftrun/<run id>/`` (``--rdzv-backend etcd``: the controller's office,
    ``controller/leadership.py``, and its journal, ``controller/journal.py``)."""

    run_id: str

    @property
    def root(self) -> str:
        return f"ftrun/{self.run_id}/"

    @property
    def leader(self) -> str:
        """The controller's agent id, on its lease."""
        return self.root + "leader"

    @property
    def journal(self) -> str:
        """The controller's state (``controller.journal.Journal``), written at each decision before its commands:
        the prefix of its parts' keys."""
        return self.root + "journal"

    def journal_part(self, name: str) -> str:
        """One part of the journal (``controller.journal.PARTS``; "": the prefix of them all)."""
        return f"{self.journal}/{name}"

    @property
    def launch(self) -> str:
        """A head node's launch of the run, on a lease of a minute: while it lives and no controller leads
        yet, the agents are starting (a head started again then follows them rather than launch again)."""
        return self.root + "launch"

    @property
    def store_record(self) -> str:
        """Where the current controller's control store listens (``controller.leadership.StoreRecord``)."""
        return self.root + "store"


#: what a generation's ``group_ready`` key says once every rank arrived (else the controller's "superseded")
GROUP_READY = "ready"
#: between the commands' texts when one ring carries several (a sealed text is JSON on one line)
BELL_SEPARATOR = "\n"
#: the doorbell ring for the rendezvous result (the commands' are their indices)
RENDEZVOUS_RING = "rendezvous"
#: the run ids of the jobs a store has served, as a sequence (``ftrun status`` picks from them)
JOBS_COUNT = "ftrun/jobs/count"
#: in a static rendezvous's worker store (on --master-port): the port of the job's control store
CONTROL_STORE = "ftrun/control_store"


def job_entry(index: int) -> str:
    return f"ftrun/jobs/{index}"
