"""What the parameter-server family refuses before launch (the section's validators catch the rest).

    check_ps_job(cfg, layout, device="cpu", resume=False)     # from components/training/job.py prepare_job

Each check names the key, the value, the rule and the fix, as layout.py does.
"""

from __future__ import annotations

from lmforge.components.errors import UserError
from lmforge.components.sections.training import TrainingConfig
from lmforge.components.training.layout import Layout


def check_ps_job(cfg: TrainingConfig, layout: Layout, *, device: str, resume: bool) -> None:
    strategy = cfg.parallel.strategy
    key = "training.parallel.strategy"
    if layout.world_size < 2:
        raise UserError("training.num_ranks", layout.world_size,
                        f"is too few for {strategy}: rank 0 is the server (and worker 0), and a parameter server with "
                        "one worker is plain single-process training", "Set training.num_ranks = 2 or more")
    if resume:
        raise UserError("--resume", strategy, "not yet: the parameter-server strategies keep no checkpoints (the server's "
                        "optimizer and, for easgd, every worker's local weights would all have to be saved)",
                        "Train without --resume, or use ddp/zero1-3 for resumable runs")
    if device != "cpu":
        raise UserError(key, strategy, "not yet: the parameter-server family runs on CPU ranks (its messages are gloo "
                        "send/recv of host tensors, and hogwild's weights live in host shared memory)",
                        "Use ddp or zero1-3 on GPUs, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to compare on CPU")
    if strategy == "hogwild" and cfg.hostfile is not None:
        raise UserError("training.hostfile", cfg.hostfile, "hogwild shares the weights in this machine's memory, so "
                        "its workers must be local processes", "Remove training.hostfile, or use ps-sync/async-sgd")
    if strategy == "easgd":
        alpha = cfg.parallel.easgd.alpha
        if alpha * layout.world_size > 1:
            raise UserError("training.parallel.easgd.alpha", alpha,
                            f"x {layout.world_size} workers = {alpha * layout.world_size:g} > 1: the center would move past "
                            "the workers' mean each round (Zhang et al. 2015 keep beta = workers x alpha <= 1)",
                            f"Use alpha <= {1 / layout.world_size:g}")
