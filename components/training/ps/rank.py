"""The rank entry of the parameter-server family, started by the same deepspeed launcher as training/rank.py.

    deepspeed --num_gpus 2 --module --no_local_rank lmforge.components.training.ps.rank --request runs/r1/request-0.json

The launcher (components/training/launcher.py command) picks this module when training.parallel.strategy is
ps-sync, async-sgd, hogwild or easgd. It reads the same RankRequest, opens a gloo process group from the
launcher's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (no DeepSpeed engine: these run beside it), builds
the same model from the same seed on every rank, trains with the chosen strategy, and rank 0 emits the
same step events (plus a `ps` block: staleness histogram, bytes sent per step, dropped updates), writes
<run>/ps_stats.json and exports the same Hugging Face folder (write_export) with a probe for tests. No
checkpoints are saved (a resume is refused before launch, components/training/ps/checks.py).
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from lmforge.components.training.protocol import (
    RankRequest,
    emit_event,
    export_meta,
    parse_rank_args,
    read_request,
    run_rank,
    watch_supervisor,
)

STATS_FILE = "ps_stats.json"


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from lmforge.components.training.batches import TokenWindows
    from lmforge.components.training.model import build_model, count_params, flops_per_token, load_tokenizer, model_config
    from lmforge.components.training.perf import devices_in_job
    from lmforge.components.training.ps.common import Ctx, FlatParams

    watch_supervisor()
    args = parse_rank_args(sys.argv[1:] if argv is None else argv)
    req = read_request(args.request)
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    dist.init_process_group("gloo", timeout=dt.timedelta(minutes=10))  # env:// from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = req.training
    (req.run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    (req.run_dir / "ranks" / f"rank{rank}.pid").write_text(str(os.getpid()))
    tokenizer = load_tokenizer(req.tokenizer)
    windows = TokenWindows.open(req.shards, seq_len=cfg.seq_len, seed=cfg.seed)
    model = build_model(cfg.model, tokenizer, seq_len=cfg.seq_len, seed=cfg.seed)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    n_params = count_params(model)
    token_flops = flops_per_token(cfg.model, model_config(cfg.model, tokenizer, seq_len=cfg.seq_len), seq_len=cfg.seq_len)
    peak = req.hardware.peak_flops_per_device * devices_in_job(req.hardware.device, world)
    strategy = cfg.parallel.strategy

    def make_ctx(buffer: torch.Tensor | None = None) -> Ctx:
        return Ctx(req=req, model=model, flat=FlatParams(model, buffer), windows=windows, rank=rank, world=world,
                   token_flops=token_flops, peak=peak, emit=emit_event)

    if rank == 0:
        print(f"{strategy}: {world} workers (rank 0 is also the server), model {n_params / 1e6:.2f}M params, "
              f"batch {req.layout.micro} x {req.layout.accum} windows per worker step", flush=True)
    ctx: Any = None
    if strategy == "hogwild":
        from lmforge.components.training.ps.hogwild import run_hogwild

        holder: list[Ctx] = []

        def keep(buffer: torch.Tensor | None) -> Ctx:
            holder.append(make_ctx(buffer))
            return holder[-1]
        weights = run_hogwild(keep, n_params, world, rank)
        ctx = holder[0]
    else:
        ctx = make_ctx()
        if strategy == "ps-sync":
            from lmforge.components.training.ps.sync import run_ps_sync as run
        elif strategy == "async-sgd":
            from lmforge.components.training.ps.sync import run_async_sgd as run
        else:
            from lmforge.components.training.ps.easgd import run_easgd as run
        weights = run(ctx)
    if rank == 0:
        assert weights is not None
        ctx.flat.data.copy_(weights)
        _export(ctx, req, tokenizer, windows, n_params, peak)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _export(ctx: Any, req: RankRequest, tokenizer: Any, windows: Any, n_params: int, peak: float) -> None:
    """Rank 0: the stats file, the probe (the trained model's logits on a fixed batch) and the export."""
    from safetensors.torch import save_file

    from lmforge.components.training.hf_export import write_export
    from lmforge.components.training.model import model_config
    from lmforge.components.workspace import atomic_write_json

    cfg, run_dir, model = req.training, req.run_dir, ctx.model
    stats = {"strategy": cfg.parallel.strategy, "workers": ctx.world, **ctx.stats.summary(),
             "bytes_sent_per_step": ctx.stats.summary()["bytes_sent"] / cfg.max_steps,
             "weights_bytes": ctx.flat.nbytes, "seconds": time.perf_counter() - ctx.t0}
    atomic_write_json(run_dir / STATS_FILE, stats)
    probe = windows.batch(np.arange(2))[0]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe).logits.float()
    save_file({"input_ids": probe, "logits": logits.contiguous()}, str(run_dir / "probe.safetensors"))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    meta = {**export_meta(req), "steps": cfg.max_steps, "final_loss": ctx.last_loss, "params": n_params, "dtype": "float32",
            "layout": req.layout.to_dict(), "peak_flops": peak,
            "parameter_server": {k: v for k, v in stats.items() if k != "staleness_hist"}}
    write_export(run_dir / "export", state, model_config(cfg.model, tokenizer, seq_len=cfg.seq_len, dtype=torch.float32),
                 tokenizer, dtype=torch.float32, meta=meta, tokenizer_dir=req.tokenizer if cfg.model.init else None)
    print(f"exported {run_dir / 'export'}", flush=True)


if __name__ == "__main__":
    run_rank(main)
