"""A cluster simulator: the production rollout manager at 64–1,024 GPUs, on virtual time.

It owns the simulated engines, relays and trainer, the virtual clock and the cost tables, and
drives the *unchanged* ``RolloutManager`` (admission, repack planner, pull-when-idle, barrier
and interrupt modes) with them, so what it predicts is what the production scheduler does.
It must never fork the scheduler: a behaviour the simulator needs belongs in the production
code (as the event-driven wake-ups did), not in a copy here.

    python -m laminar_mcore.sim.report --json out.json [--sweep-placement | --sensitivity |
        --fail MACHINE@T]

Modules: ``clock`` (the virtual-time event loop), ``costs`` (roofline costs and each system's
protocol constants, one table with sources), ``workload`` (DAPO-Math-like lengths), ``engine``
(continuous batching with KV capacity, SGLang's client surface), ``network`` (machines' NICs
shared by concurrent transfers), ``relays`` (how a version reaches engines per system: relays
and Laminar's chain, a global NCCL broadcast, a colocated reshard), ``faults`` (a rollout
machine killed and its recovery), ``cluster`` (the trainer, one run of one mode, measured as
the paper measures), ``placement`` (each system's split sweep), ``paper`` (the paper's figures
beside ours), ``sensitivity`` (constants +-20%), ``report`` and ``extras`` (the table, the
sensitivity and failure runs), ``calibrate`` (a benchmark: the same simulator fed with this
machine's measured costs against ``bench.modes``).
"""
