"""Mixture of Experts on the ranks: transformers' Qwen3-MoE blocks run as DeepSpeed MoE layers, and back.

    model = build_model(cfg.model, tok, seq_len=128, seed=0)                 # a seeded Qwen3MoeForCausalLM
    blocks = swap_in_deepspeed_moe(model, cfg.model.moe, ep_size=2, ep_rank=rank % 2)
    groups = optimizer_groups([p for p in model.parameters() if p.requires_grad])   # for deepspeed.initialize
    loss = lm_loss + cfg.model.moe.aux_loss_coef * aux_loss(blocks)
    stats = MoeStats.zeros(num_experts, device); stats.add(blocks)          # after each forward
    state = with_all_experts(gather_hf_state(engine, ...), engine.module, num_experts)   # collective; rank 0 gets it

Each sparse block (`Qwen3MoeSparseMoeBlock`: a router and the experts as fused 3D tensors,
gate_up_proj [E, 2I, H] and down_proj [E, H, I]) is replaced by a DeepSpeedMoeBlock wrapping
`deepspeed.moe.layer.MoE` with `ep_size` = the expert-parallel degree. The router's weight
becomes the gate's `wg`, and each rank copies its own experts' slices of the fused tensors into
SwiGLU MLPs of the same shape, so every expert-parallel degree starts from the same weights.
Expert parallel groups are consecutive ranks (DeepSpeed's default), so a rank's expert-parallel
rank is rank % ep_size and it holds experts ep_rank * E/ep .. (ep_rank + 1) * E/ep - 1.

Routing equals transformers' in eval: softmax over the experts, top-k, and (top_k > 1)
renormalised, which model.py's moe_config matches with norm_topk_prob = top_k > 1. Training
drops tokens past `capacity_factor`; eval's capacity holds every token (EVAL_CAPACITY), so the
engine's eval logits are the exported Qwen3-MoE model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmforge.components.sections.training import MoeConfig

DS_GATE = ".moe.deepspeed_moe.gate.wg.weight"
DS_EXPERTS = ".moe.deepspeed_moe.experts.deepspeed_experts."
MIN_CAPACITY = 4


class ExpertMLP(nn.Module):
    """One expert as transformers' Qwen3MoeExperts computes it: down(act(gate) * up), gate and up fused in one weight."""

    def __init__(self, hidden: int, width: int, act: nn.Module) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * width, bias=False)
        self.down = nn.Linear(width, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


def eval_capacity(num_experts: int) -> float:
    """An eval capacity factor that never drops a token: capacity = tokens / E x factor x k >= every token an expert
    could be sent (at most all of them, once each)."""
    return float(num_experts)


class DeepSpeedMoeBlock(nn.Module):
    """A decoder layer's MLP as deepspeed.moe.layer.MoE; returns the hidden states the layer expects and keeps the
    last forward's auxiliary loss, per-expert token counts and dropped routes for the rank loop."""

    def __init__(self, hidden: int, width: int, act: nn.Module, cfg: MoeConfig, *, ep_size: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.moe = MoE(hidden, expert=ExpertMLP(hidden, width, act), num_experts=cfg.num_experts, ep_size=ep_size,
                       k=cfg.top_k, capacity_factor=cfg.capacity_factor, eval_capacity_factor=eval_capacity(cfg.num_experts),
                       min_capacity=MIN_CAPACITY, drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False)
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None   # routes past an expert's capacity, this forward
        self.routes = 0                            # token x top_k routes, this forward
        self.moe.deepspeed_moe.gate.register_forward_hook(self._count_dropped)

    def _count_dropped(self, _module: Any, _inputs: Any, out: Any) -> None:
        # MOELayer asks the gate for sparse routes: out[3] holds each route's expert, -1 where capacity dropped it.
        routes = out[3]
        self.dropped, self.routes = (routes < 0).sum(), routes.numel()

    @property
    def local_experts(self) -> nn.ModuleList:
        return self.moe.deepspeed_moe.experts.deepspeed_experts

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out, self.l_aux, self.exp_counts = self.moe(hidden_states)
        return out


def _sparse_blocks(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(decoder layer, its Qwen3-MoE sparse block) for every layer that has experts."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return [(layer, layer.mlp) for layer in model.model.layers if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]


@torch.no_grad()
def swap_in_deepspeed_moe(model: nn.Module, cfg: MoeConfig, *, ep_size: int, ep_rank: int) -> list[DeepSpeedMoeBlock]:
    """Replace each sparse block of a Qwen3MoeForCausalLM by a DeepSpeedMoeBlock holding the same router and this
    rank's experts (global ids ep_rank x E/ep_size onwards); returns the new blocks in layer order."""
    blocks = []
    for layer, hf in _sparse_blocks(model):
        experts = hf.experts
        block = DeepSpeedMoeBlock(experts.hidden_dim, experts.intermediate_dim, experts.act_fn, cfg, ep_size=ep_size)
        block.moe.deepspeed_moe.gate.wg.weight.copy_(hf.gate.weight)
        first = ep_rank * len(block.local_experts)
        for i, expert in enumerate(block.local_experts):
            expert.gate_up.weight.copy_(experts.gate_up_proj[first + i])
            expert.down.weight.copy_(experts.down_proj[first + i])
        layer.mlp = block
        blocks.append(block)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no Qwen3-MoE sparse block to run as DeepSpeed MoE")
    return blocks


def optimizer_groups(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    """The parameters as DeepSpeed's MoE-aware optimizers expect them: dense ones in one group, each expert-parallel
    group's experts in a group marked `moe` (whose gradients are reduced over the expert-data-parallel ranks only)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense"})


def aux_loss(blocks: list[DeepSpeedMoeBlock]) -> torch.Tensor:
    """The load-balancing loss of the last forward, summed over the MoE layers."""
    assert all(b.l_aux is not None for b in blocks), "aux_loss before a forward"
    return torch.stack([b.l_aux for b in blocks]).sum()  # type: ignore[misc]


@dataclass
class MoeStats:
    """One step's routing on this rank, kept on the device: per-expert tokens (over layers), dropped and all routes,
    and the auxiliary loss summed over layers and micro-batches. Read back only on logged steps."""

    tokens: torch.Tensor
    dropped: torch.Tensor
    routes: torch.Tensor
    aux: torch.Tensor
    forwards: int = 0

    @classmethod
    def zeros(cls, num_experts: int, device: torch.device | str) -> "MoeStats":
        z = torch.zeros((), dtype=torch.float64, device=device)
        return cls(torch.zeros(num_experts, dtype=torch.float64, device=device), z.clone(), z.clone(), z.clone())

    def add(self, blocks: list[DeepSpeedMoeBlock]) -> None:
        for b in blocks:
            assert b.exp_counts is not None and b.dropped is not None
            self.tokens += b.exp_counts.detach().to(self.tokens)
            self.dropped += b.dropped.to(self.dropped)
            self.routes += b.routes
        self.aux += aux_loss(blocks).detach().to(self.aux)
        self.forwards += 1

    def as_floats(self) -> list[float]:
        """[aux summed, forwards, dropped, routes, tokens per expert...]: what the rank gathers from every rank."""
        head = torch.stack([self.aux, torch.tensor(float(self.forwards), dtype=torch.float64, device=self.aux.device),
                            self.dropped, self.routes])
        return torch.cat([head, self.tokens]).tolist()


def summarize(rows: list[list[float]]) -> dict[str, Any]:
    """Every rank's MoeStats.as_floats as event fields: the mean auxiliary loss of a forward (summed over layers),
    tokens routed to each expert (all layers, all ranks, before capacity) and the fraction of routes dropped."""
    total = [sum(col) for col in zip(*rows, strict=True)]
    aux, forwards, dropped, routes, tokens = total[0], total[1], total[2], total[3], total[4:]
    return {"moe_aux_loss": aux / max(forwards, 1.0), "expert_tokens": [int(t) for t in tokens],
            "moe_dropped_fraction": dropped / max(routes, 1.0)}


def _layer_prefix(key: str, marker: str) -> str:
    """'model.layers.3.mlp' from a DeepSpeed key holding `marker`."""
    return key.split(marker, 1)[0]


def local_experts(module: nn.Module, *, ep_rank: int | None = None) -> dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]:
    """This rank's experts on the host: (layer's mlp prefix, global expert id) -> (gate_up, down) weights.
    The expert-parallel rank is DeepSpeed's (its groups must exist) unless given."""
    out = {}
    for name, sub in module.named_modules():
        if isinstance(sub, DeepSpeedMoeBlock):
            prefix = name.removeprefix("module.")
            ep_rank = _ep_rank(sub) if ep_rank is None else ep_rank
            for i, expert in enumerate(sub.local_experts):
                gid = ep_rank * len(sub.local_experts) + i
                out[(prefix, gid)] = (expert.gate_up.weight.detach().cpu(), expert.down.weight.detach().cpu())
    return out


def _ep_rank(block: DeepSpeedMoeBlock) -> int:
    ep_size = block.moe.ep_size
    if ep_size == 1:
        return 0
    import torch.distributed as dist

    return dist.get_rank(group=block.moe.deepspeed_moe.ep_group)  # the group DeepSpeed set on the layer at initialize


def hf_moe_state(state: dict[str, torch.Tensor], experts: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]],
                 num_experts: int) -> dict[str, torch.Tensor]:
    """A Qwen3-MoE state dict from the DeepSpeed model's state (dense weights, gates) and every expert by global id:
    gate wg -> mlp.gate.weight, experts stacked into mlp.experts.gate_up_proj and down_proj."""
    out = {}
    for key, value in state.items():
        if DS_EXPERTS in key:
            continue  # only this rank's experts, under local ids: rebuilt from `experts`
        out[_layer_prefix(key, DS_GATE) + ".gate.weight" if key.endswith(DS_GATE) else key] = value
    for prefix in sorted({p for p, _ in experts}):
        missing = [e for e in range(num_experts) if (prefix, e) not in experts]
        assert not missing, f"{prefix}: experts {missing} were gathered from no rank"
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack([experts[(prefix, e)][0] for e in range(num_experts)])
        out[f"{prefix}.experts.down_proj"] = torch.stack([experts[(prefix, e)][1] for e in range(num_experts)])
    return out


def with_all_experts(state: dict[str, torch.Tensor] | None, module: nn.Module,
                     num_experts: int) -> dict[str, torch.Tensor] | None:
    """Collective: every rank sends its experts to rank 0, which turns the engine's state (gather_hf_state's, rank 0
    only) into the Qwen3-MoE state dict; other ranks get None. Ranks of different expert-data-parallel replicas send
    the same experts; one copy of each is kept."""
    import torch.distributed as dist

    rank = dist.get_rank()
    parts: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(local_experts(module), parts, dst=0)
    if rank != 0:
        return None
    assert state is not None and parts is not None
    merged: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for part in parts:
        merged.update(part)
    return hf_moe_state(state, merged, num_experts)


class MoeRun:
    """What the rank loop does for MoE, in one place: swap the blocks in, add the auxiliary loss to each micro-batch's
    loss while counting the routing, and hand a logged step's figures (gathered from every rank) to the event.

        moe = MoeRun.attach(model, cfg.model.moe, ep_size=2, rank=rank)
        moe.start_step(engine.device)
        engine.backward(lm + moe.loss_term())        # after the forward
        fields = moe.event(comms.gather_floats)      # every rank calls it on a logged step
    """

    def __init__(self, blocks: list[DeepSpeedMoeBlock], cfg: MoeConfig) -> None:
        self.blocks, self.cfg = blocks, cfg
        self.stats: MoeStats | None = None

    @classmethod
    def attach(cls, model: nn.Module, cfg: MoeConfig, *, ep_size: int, rank: int) -> "MoeRun":
        return cls(swap_in_deepspeed_moe(model, cfg, ep_size=ep_size, ep_rank=rank % ep_size), cfg)

    def check_groups(self, rank: int) -> None:
        """After deepspeed.initialize formed the expert-parallel groups: this rank holds the experts they say it does."""
        for block in self.blocks:
            assert _ep_rank(block) == rank % block.moe.ep_size, (rank, block.moe.ep_size, _ep_rank(block))

    def start_step(self, device: torch.device | str) -> None:
        self.stats = MoeStats.zeros(self.cfg.num_experts, device)

    def loss_term(self) -> torch.Tensor:
        """aux_loss_coef x the last forward's load-balancing loss; its routing is added to the step's counts."""
        assert self.stats is not None, "start_step first"
        self.stats.add(self.blocks)
        return self.cfg.aux_loss_coef * aux_loss(self.blocks)

    def event(self, gather: Any) -> dict[str, Any]:
        """The step's MoE fields for the metrics event; `gather` is DeviceCollectives.gather_floats (a collective)."""
        assert self.stats is not None, "start_step first"
        return summarize(gather(self.stats.as_floats()))
