"""Parameter server over c10d point-to-point (gloo): transport (:mod:`.transport`), the
server loop (:mod:`.server`) and the learner loop (:mod:`.learner`).

The server ranks run :func:`run_server` with an :class:`~distsgd.protocols.base.
AsynchronousProtocol` (Rudra's :class:`~distsgd.protocols.ParameterServer` in hardsync,
n-softsync or async mode, Omnivore's :class:`~distsgd.protocols.ComputeGroups`, or on one
server rank :class:`~distsgd.protocols.BackupHardSync`, the served form of hardsync's
backup rule, which the simulated cluster drives too); the learner ranks run
:func:`run_learner`. Otherwise the protocol object is the very one the simulated cluster
drives (``distsgd.runtime.sim``): the server calls ``push``/``can_pull``/``pull``
in the order messages really arrive, so the staleness and vector clock of every update
(:class:`~distsgd.protocols.base.Update`) are those of the real run; the transport never
recomputes them. ``torch.distributed`` must already be initialised with the gloo backend,
and *every* rank of the default process group must call :func:`run_server` or
:func:`run_learner` (they first create the point-to-point process groups, collectively).

Roles (Rudra: Gupta, Zhang, Wang, ICDM 2016, arXiv:1509.04210, parameter server and
learners; docs/protocols.md §2). ``PSLayout.worker_groups[w]`` are the learner ranks of protocol
worker ``w``. With one rank each it is a learner of the parameter server; with several it
is an Omnivore compute group (Hadjis et al., arXiv:1606.04487; docs/protocols.md §3): every member
computes a gradient on the same pulled weights, the gradients are mean-all-reduced in the
group's process subgroup (synchronous inside the group), and only the leader (``[0]``)
talks to the server(s); it broadcasts the pulled weights to the members.

Flow (as ``sim._advance_async``). The server sends WEIGHTS (``protocol.pull``) to every
leader at start. On a PUSH it calls ``protocol.push(worker, grad, version, lr(samples))``,
then replies WEIGHTS at once if ``protocol.can_pull(worker)``, else (hardsync barrier)
when an update releases the worker; only then does the coordinator call ``on_push``, so
learners compute while ``on_push`` runs (evaluation, metrics). When ``on_push`` returns
False, every worker's next PUSH is refused with STOP (not applied), and workers held by
the barrier get LAST (their push was applied). A learner therefore computes one gradient
more than was applied. Which server versions were pulled, and when, is all the protocol
needs: staleness σ = version applied to − version pulled.

Sharding (Rudra-adv, ICDM 2016; docs/protocols.md §2). With S server ranks, shard ``k`` owns the
slice ``shard_bounds(P, S)[k]`` of the flat parameters and runs its own protocol object
built on that slice; ``server_ranks[0]`` is the coordinator (``on_push``, stop, central
weights). A leader pushes the slices *in shard order*, each after the previous shard's
reply, so that a push the coordinator refused reaches no other shard, and one it applied
(WEIGHTS or LAST) reaches them all: every shard applies exactly the same pushes. Each
shard applies them in its own arrival order, so under async (c = 1) every shard ends at
the same version, but the interleaving of learners, hence σ and the vector clocks, may
differ between shards: the figures given to ``on_push`` (and the run's staleness
histogram) are the coordinator's; the others are kept by each shard's protocol. The
learner computes on the concatenated slices, with the coordinator's version, and pushes
to each shard the version that shard sent it. The cost of the shard order is one more
message latency per shard and push. Only the coordinator refuses pushes; the other
shards apply every push they get. Under the hardsync barrier a stop that falls inside a
round leaves the same gradients buffered on every shard; the other shards release their
held learners with LAST once a learner has said BYE.

Message protocol. Every message is a header, an int64 tensor of :data:`HEADER_LEN`
entries, followed by one flat float32 payload when ``length > 0``; both go with tag
:data:`TAG` over the pair's own process group (gloo keeps them in order):

======  ========  ==========================================================================
index   field     meaning
======  ========  ==========================================================================
0       kind      PUSH, WEIGHTS, STOP, LAST, BYE, GATHER, REFUSED (module constants)
1       version   PUSH: this shard's version the gradient was computed on; WEIGHTS: the
                  version of the weights sent; GATHER: coordinator's push count
2       samples   PUSH: samples behind the gradient (group size × ``num_samples``)
3       losses    PUSH: number of losses after the gradient in the payload (shard 0 only)
4       worker    protocol worker index of the leader concerned
5       length    float32 elements of the payload that follows (0: none)
6–9     position  WEIGHTS: the learner's new data position (λ, slot, epoch, step) after a
                  membership change (λ = 0: it keeps drawing where it is; see Membership)
======  ========  ==========================================================================

* learner → server PUSH, payload ``[n + losses]``: the gradient slice (shape ``[n]``,
  n = the shard's slice length), then the group's losses.
* server → learner WEIGHTS, payload ``[n]``: the weights slice from ``protocol.pull``.
* coordinator → learner STOP: push refused, leave. server → learner LAST: push applied,
  carry it on to the later shards, then leave. learner → server BYE: this worker leaves
  (S > 1). coordinator → joiner REFUSED (no payload; ``worker``: the learners λ + 1 it
  would have made, ``samples``: the training samples N): not admitted, λ·b would exceed N.
* coordinator → shard GATHER: answer WEIGHTS with the slice (``eval_weights``) once as
  many pushes as the coordinator had are applied; STOP: the final slice, once every
  learner has left. Compute groups use ``broadcast`` of ``[kind, version, P]`` and of the
  weights, and one ``all_reduce`` (sum) of ``[P + members × losses]``.

Channels. Each (server, leader) and (coordinator, shard) pair has its own two-rank gloo
process group. Measured with torch 2.13: a pending gloo receive can be neither polled
(``is_completed`` turns true only inside ``wait``) nor aborted, and a receive that times
out makes gloo close *every* pair of its process group ("Application timeout caused pair
closure"). One group per pair confines a timeout to the silent learner's channel. The
server waits for each leader in a thread (one blocking receive at a time, armed after
each reply) that hands messages to the server loop through a queue. The server starts
each reply's send and goes on with the next push while it crosses (a reply to a learner
behind a slow link holds that learner only); the send is awaited before the next message
to that learner, by when it has completed (the learner pushes only once it has its
weights).

Faults (Rudra, ICDM 2016: under async and n-softsync the server never waits for a
particular learner, under hardsync it waits for all λ; Omnivore: a group is synchronous
inside, so it stands or falls as one):

* A leader whose process dies is seen at once: its TCP connection closes and the pending
  receive fails. A leader silent for ``timeout_s`` after
  the server's last reply to it is lost too (its channel closes, so if it wakes up its
  next push fails and it raises :class:`ServerLost`). Without a barrier the server logs
  the rank through ``log`` and goes on. With elastic membership (see Membership) the
  lost learner is retired: λ and c refit and the others take over its data. Without it
  the protocol is left as it is: n-softsync keeps its threshold c = ⌊λ/n⌋, which the
  remaining learners fill (a fast learner may contribute twice to one update, as in
  Rudra's 1-softsync). Either way a lost learner's buffered gradient stays in the
  buffer. Under the hardsync barrier (``protocol.barrier``)
  no update can complete: :class:`LearnerLost` naming the rank; likewise once fewer than
  ``protocol.workers_needed`` workers are left (hardsync with backup learners needs λ of
  its λ + β). Every worker lost: :class:`LearnerLost` as well.
* A group member dies: the group's collective fails in the leader and the members, which
  raise :class:`LearnerLost` naming the group's ranks; the server then loses the leader.
* The server (any shard) dies, or is silent for ``timeout_s`` while a leader waits for
  its reply: the leader raises :class:`ServerLost` naming that server rank (measured:
  0.02 s after SIGKILL), after telling its members, which raise it too. A lost shard
  makes the coordinator raise :class:`ServerLost` naming it.

Membership (docs/elastic.md; one server rank, learners of one rank, no barrier:
``run_server``'s ``shards``). A lost learner is retired (``protocol.retire``: λ and c
refit). A learner joins the running run through the run's c10d store
(:class:`JoinWatch`): it takes an id with ``store.add``, both sides make a two-rank
``ProcessGroupGloo`` under that id's prefix (:func:`join_channel`, the channel kind every
learner has), and the server loop admits it (``protocol.admit``) and sends it WEIGHTS. At
each change the server re-shards the active learners from the minibatches each has drawn
(:class:`~distsgd.data.ElasticShards`: a learner draws one per WEIGHTS it receives) and
puts each one's new position into its next WEIGHTS header, so its next draw comes from
the new layout and no sample is drawn twice in an epoch.

``timeout_s`` must exceed the longest legitimate silence: the start of the server (the
learners' first wait), one compute plus its group all-reduce, ``on_push`` of the
coordinator, and under the barrier the slowest learner's round. Given ``silence_s``
(the dist runtime passes its heartbeats), a leader waits for a server's reply as long as
that server's heartbeat goes on instead, so a long ``on_push`` (an evaluation) is no
silence; a compute group's other members still wait ``timeout_s`` in the group's
broadcast.

Changes against the design note (``ps_api``): :func:`run_server` takes ``lr`` (the base
learning rate α0 from the schedule as a function of the samples applied before the push,
as the server calls ``protocol.push(..., lr)``); instead of a module-level
``gather_weights``, :class:`PushEvent` carries ``central_weights()`` (all shards' slices,
usable from inside ``on_push``) and :class:`ServerResult` the final ``weights`` on the
coordinator; :class:`PushEvent` also carries the leader's ``rank``; every rank calls
``run_server``/``run_learner`` (collective channel setup); STOP is given to the *next*
push after ``on_push`` returns False, not to the push being handled.
"""

from distsgd.runtime.ps.learner import LearnerResult, run_learner
from distsgd.runtime.ps.server import JoinWatch, PushEvent, ServerResult, run_server
from distsgd.runtime.ps.transport import (
    HostStaging,
    JoinRefused,
    LearnerLost,
    PSLayout,
    ServerLost,
    join_channel,
    shard_bounds,
    to_host,
)

__all__ = [
    "PSLayout",
    "PushEvent",
    "ServerResult",
    "LearnerResult",
    "JoinRefused",
    "LearnerLost",
    "ServerLost",
    "shard_bounds",
    "HostStaging",
    "to_host",
    "run_server",
    "run_learner",
    "JoinWatch",
    "join_channel",
]
