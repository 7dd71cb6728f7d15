"""Training: a LlamaForCausalLM (or, with experts, a Qwen3-MoE) trained with DeepSpeed (DDP, ZeRO-1/2/3, offload,
pipeline, AutoTP, expert parallelism: moe.py).

    layout = check_layout(cfg.training, vocab_size, world_size)     # components/training/layout.py
    ds_config = deepspeed_config(cfg.training, layout)               # components/training/strategies.py
    result = launch(request)                                         # components/training/launcher.py

The rank entry point is `python -m lmforge.components.training.rank` (run by the deepspeed launcher).
Device, precision and peak FLOP/s come from components/runtime/accelerator.py and perf.py, decided in job.py.
A resume on another number of ranks goes through DeepSpeed's universal checkpoint: universal.py.
The parameter-server family (ps-sync, async-sgd, hogwild, easgd) runs beside DeepSpeed from its own rank
entry, `python -m lmforge.components.training.ps.rank`, under the same launcher: ps/.
"""
