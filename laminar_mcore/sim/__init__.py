"""A cluster simulator: the production rollout manager at 64–1,024 GPUs, on virtual time.

It owns the simulated engines, relays and trainer, the virtual clock and the cost tables, and
drives the *unchanged* ``RolloutManager`` (admission, repack planner, pull-when-idle, barrier
and interrupt modes) with them, so what it predicts is what the production scheduler does.
It must never fork the scheduler: a behaviour the simulator needs belongs in the production
code (as the event-driven wake-ups did), not in a copy here.

    python -m laminar_mcore.sim.report --json out.json [--sweep-placement]

Modules: ``clock`` (the virtual-time event loop), ``costs`` (roofline costs, one table with
sources), ``workload`` (DAPO-Math-like lengths), ``engine`` (continuous batching with KV
capacity, SGLang's client surface), ``cluster`` (relays with Laminar's chain, the trainer, one
run of one mode), ``report`` (the table beside Laminar's published figures), ``calibrate``
(the same simulator fed with this machine's measured costs against ``bench.modes``).
"""
