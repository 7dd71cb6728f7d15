"""The parameter-server family: ps-sync, async-sgd, hogwild and easgd, run beside DeepSpeed, not inside it.

    lmforge run train --set training.parallel.strategy=async-sgd --set training.parallel.async_sgd.max_staleness=2

Rank 0 is the server (master weights and the optimizer) and also a worker, so 2 ranks give 2 workers.
Modules: rank.py (the rank entry the launcher starts instead of components/training/rank.py), common.py
(the worker's gradient, flat weights, what is logged), sync.py (ps-sync, async-sgd: gloo send/recv to
rank 0), hogwild.py (lock-free updates to weights in shared memory), easgd.py (elastic averaging),
checks.py (what is refused before launch).
"""
