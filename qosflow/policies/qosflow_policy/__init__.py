"""qosflow's own policy: QoS first, GPU sharing where it pays, no preemption.

One round, in Blox's stages, over a snapshot of the cluster (the same code runs in the simulator
and in the live worker):

1. **Admission.** A deadline job that can no longer meet its deadline even alone and at once
   (waiting allowance < 0, GENIE's allowance = deadline - now - predicted remaining time) is
   served as best effort, and says so: serving hopeless jobs first is how allowance-ordered
   schedulers lose their DSR under load.
2. **Ordering.** Shortest predicted remaining time first, with jobs that can still meet a
   deadline weighted `qos_weight` times (a weighted SJF: QoS jobs jump the queue, yet a long QoS
   job does not block short best-effort ones). Two guards keep everyone moving:
   * *makespan guard*: a job whose remaining time is at least `makespan_beta` x the backlog (the
     known work divided by the GPUs) starts early, longest first -- otherwise SJF leaves the
     longest jobs to the very end and they alone set the makespan. Work keeps arriving while a job
     runs, though, and keeps the cluster busy whatever the job does: with `makespan_inflow` the
     backlog a job of remaining time r is measured against also counts the GPU work that arrived
     in the last r seconds (a stand-in for what will arrive while it runs), so under steady load
     only jobs longer than the backlog itself are guarded, and the old rule returns once arrivals
     stop. Without it, a load near 1 (backlog of hours) made most multi-day jobs "long" and every
     burst was served longest first (docs/policies.md). With `makespan_longest` that backlog is
     never taken as shorter than the longest known job's remaining time (no schedule ends before
     that job does), so a job with slack against it waits its turn. A deadline job is guarded only
     once it alone is as long as the whole backlog (it ends last whatever else runs); and the job
     that ends last is never slowed by a partner (every hour it loses is an hour of makespan);
   * *starvation guard*: the job that has waited longest past the starvation bound goes first
     (and gets a reservation), one at a time and within `guard_share` of the GPUs, so every job
     starts eventually without the queue turning into FIFO under sustained overload. The bound is
     `starvation_bound`, or the backlog if that is longer (`starvation_backlog`): a job is starving
     once it has waited longer than the cluster needs to clear all the work it knows of, i.e.
     longer than first-come-first-served would have made it wait -- but never longer than
     `BACKLOG_CAP` times the backlog it found when it was queued, so that every job starts even
     if the backlog grows for ever. A fixed bound under a backlog of months fires on every long
     job, turns the guard into a FIFO lane, and makes the schedule hinge on which job happens to
     be oldest when a node frees (docs/policies.md).
   * *fairness between users* (`fair_share`, on by default): a user whose recent GPU usage is over
     their fair share goes, within each class of the queue (guarded, then the rest), behind the other
     users' jobs -- only while another user's GPU job waits. A user's share is the GPUs (up) over the
     users with jobs waiting or running, in proportion to `fair_weights` (1 each); their recent usage is
     the GPUs they held on average, each GPU-second received weighted 2^(-age / `fair_half_life`)
     (Slurm's decayed usage; 0: the GPUs they hold now); over means more than (1 + `fair_margin`) x
     the share. A job that can still meet its deadline, a CPU-only job and the starvation guard's job
     keep their place; the order changes, never whether free GPUs are used (work-conserving). A job's
     user is `Job.user`, else `QoSSpec.user` (a stage's `@qos_task(user=...)` or its pipeline run's
     `user:NAME` tag); jobs without one count as one user, so with one user or none known nothing
     changes, job by job. A job moved behind others' says so in its waiting note ("1 job of other
     users first: user sweep has held 30.7 GPUs on average recently (half-life 60 min), over their
     fair share of 16.0 of the 32 GPUs (2 users with jobs)").
3. **Placement**, job by job in that order:
   a. free GPUs, consolidated, best fit -- with `align`, first on the node whose busy time the
      job extends least (time-aligned packing: jobs that end together share a node, so nodes
      empty whole and gangs can start without preemption; it pays with express nodes, not on
      its own: see docs/policies.md); fractional shares by a fragmentation-aware scorer
      (FGD's gradient, ATC'23) when one is given, best fit otherwise. On a cluster of mixed GPU
      models (`gpu_models`, module `gpu_models`) remaining times are read in wall time at each
      job's speed on its model, and the model is chosen by that speed: the fastest that ends it
      soonest while nothing queues behind it, else the slowest that costs it at most the median
      waiting job's time (and keeps its deadline), so the fast GPUs go to the long jobs;
   b. otherwise share GPUs that each hold one shareable job (SJF-BSBF's co-location, at most two
      jobs per GPU): on each node the partners with the largest GPU-throughput balance first
      (or, with `partner_rank="benefit"`, SJF-BSBF's benefit), on the node where the GPUs gain
      most throughput. Slowdowns come from the estimator (measured
      pairs, or the jobs' per-iteration resource profiles, so that jobs with different bottlenecks
      pair up as Muri interleaves them). A co-location is taken when
      - the job can still meet its deadline and still meets it shared (on the error band: below), or
      - every partner's pair completes sooner on average than if the job waited for it
        (SJF-BSBF's t_con < t_seq: share now rather than at the partner's end) and the GPUs lose
        no throughput, or
      - while work queues, the GPUs do `throughput_gain` more work per GPU shared than alone
        (counting what a partner's whole gang loses), or
      - (option `share_after=k`, off by default) the job, best effort, has waited k times its own
        time, every partner's pair completes sooner on average (SJF-BSBF) and the GPUs lose less
        than `DL_COST_FLOOR` (-0.5) GPU-throughput per GPU;
      and never when a partner would miss a deadline it can still meet, nor (option `long_pairs`,
      off by default) when the job and its partner both have more than `long_pairs` seconds to run
      (the second slot of a GPU holding a long job stays for shorter jobs). If the pair's memory
      does not fit, the newcomer runs a smaller sub-batch with gradient accumulation (same global
      batch, so the same convergence);
   b'. (before b, for a deadline gang that declared `min_gpus`) an *elastic start*: GPUs of its own
      on fewer of its GPUs, with gradient accumulation keeping the global batch, if at that share of
      its speed it still meets its deadline (pessimistically too, on the error band) -- free GPUs of
      its own slow no partner down (module `elastic`; option `elastic`);
   c. otherwise, once the job has waited `relax_after` (Philly: locality is relaxed after a
      bounded wait), spread it over nodes -- only if the predicted spread slowdown costs less than
      waiting for a consolidated slot;
   d. otherwise it waits, and a blocked multi-GPU job near the head of the queue (or one with a
      deadline) reserves the node(s) that free up soonest (EASY backfilling: others may still use
      them if predicted to finish before the reservation starts -- pessimistically if it keeps a
      deadline promise; new reservations only while fewer
      than `reserve_share` of the nodes are reserved -- the last one may take all the nodes its gang
      needs, or a gang wider than that share could never start). A waiting 1-GPU job that the makespan
      or starvation guard puts first reserves the GPU whose jobs end soonest (`reserve_single`): no job
      joins it, so it empties and the job takes it -- on a cluster whose GPUs are shared, each job
      leaving a GPU otherwise made room for a newcomer next to the one that stayed, and no GPU ever
      emptied for the job the guard had put first (docs/policies.md).
   e. *express nodes* (`express_share` of the nodes, once any job has a deadline): a standing
      reservation `express_max_s` ahead, so they only take jobs done by then -- and a deadline job
      of at most `express_deadline_s` whose slack is shorter than the predicted wait for a
      regular node. Without preemption, a short gang with minutes of slack can only start at
      once if a node is kept (nearly) free for it; the price is that node's idle time.
4. **CPU cores** (CODA): a GPU job gets its request plus spare cores up to where the estimator
   says its speed stops growing; CPU-only jobs never take the cores a node's idle GPUs need.

**Deadline promises on the error band** (`deadline_band`, on by default). An estimator may state
how far off it may be (`qosflow.core.estimate.remaining_high` / `pair_slowdown_high`: about the
90th percentile of the truth; the oracle states no band, so its runs do not change). Where the
policy promises a deadline it checks it at those pessimistic values; elsewhere (ordering, JCT-driven
sharing, the makespan guard) it keeps the point estimates:

* a deadline job shares GPUs (3b) or is rescued over nodes (deadline rescue) only if it meets its
  deadline at its pessimistic remaining time and slowdown -- unless waiting for consolidated GPUs
  of its own would miss it pessimistically too, when starting slowed now is its best chance (the
  point-estimate check then decides, as without a band);
* a job backfills a node reserved for a deadline job, or an express node, only if it is done
  before the reservation starts at its pessimistic remaining time.

With +-30 % noise this halves the DSR lost against the oracle on the Muri trace
(docs/policies.md, "Deadline promises on the estimator's error band").

Every choice is explained in `Decision.notes` (why a job waits, shares, or jumped the queue). A job
that waits although GPUs it might share exist says why it did not share, in the words of the check
that refused it: its deadline would be missed shared (with the least slowdown on offer), the pair
would not pay, partners would lose too much or miss their own deadline, or the partners are on the
critical path.

**Cost of a round.** Placement searches that depend only on a request's shape and the cluster's
state (free whole GPUs, the GPUs a deadline rescue may take, the nodes a share may use) run once per
shape and state: the state changes only when a job is placed, and a long queue holds few shapes.
What depends on the job itself (its partners, its deadline, the node ranked by its remaining time)
is decided per job. docs/bench/decisions.md measures a round.

**Where it lives.** This package holds the policy, one module per concern:

* `policy` -- `QosflowPolicy`: its options and the round (`schedule`).
* `ordering` -- steps 1 and 2, admission and ordering: weighted SJF, the makespan guard (with its
  arrival log), the starvation guard (`BACKLOG_CAP`) and fairness between users (with its usage log).
* `colocation` -- step 3b, GPU co-location: the partner search, whether a pair pays, the pairing
  plan, why a job did not share (`CRITICAL_SHARE`, `LAST_END_SHARE`).
* `deadlines` -- deadline promises: the deadline rescue and the checks on the error band.
* `whole_gpus` -- steps 3a and 3c, GPUs of a job's own: consolidated (or time-aligned), around
  reservations, or spread once locality is relaxed.
* `elastic` -- step 3b', elastic starts on fewer GPUs (`QoSSpec.min_gpus`).
* `reservations` -- step 3d, when GPUs free up: the wait for a consolidated slot, reservations.
* `express` -- step 3e, express nodes (`EXPRESS`) and when the lane is open.
* `cores` -- step 4, CPU cores (`GPU_FEED_CORES`).
"""

from qosflow.policies.qosflow_policy.colocation import CRITICAL_SHARE, LAST_END_SHARE
from qosflow.policies.qosflow_policy.cores import GPU_FEED_CORES
from qosflow.policies.qosflow_policy.express import EXPRESS, _DeadlineArrivals
from qosflow.policies.qosflow_policy.ordering import BACKLOG_CAP, _ArrivalLog
from qosflow.policies.qosflow_policy.policy import QosflowPolicy

# (the arrival logs are re-exported for the tests that drive them directly)
__all__ = [
    "BACKLOG_CAP",
    "CRITICAL_SHARE",
    "EXPRESS",
    "GPU_FEED_CORES",
    "LAST_END_SHARE",
    "QosflowPolicy",
    "_ArrivalLog",
    "_DeadlineArrivals",
]
