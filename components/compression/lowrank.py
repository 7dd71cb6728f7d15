"""Low-rank: truncated SVD of Linear layers, with each layer's rank chosen by energy or a budget.

    out = lowrank_variant(model_dir, out / "lowrank", LowRankConfig(mode="budget", param_budget=0.5))
    ranks = choose_ranks(spectra, LowRankConfig(mode="energy", energy=0.9))

A layer W (out x in) becomes up(down(x)) with down = sqrt(S_r) V_r^T and up = U_r sqrt(S_r):
r * (in + out) parameters instead of in * out. By Eckart-Young this is the best rank-r
approximation, and for any x the output error |W x - W_r x| is at most s_{r+1} |x|.

- mode=energy: each layer keeps the smallest r whose sum of s_i^2 reaches `energy` of its total.
- mode=budget: singular values are taken across all target layers greedily, best share of
  their layer's energy per parameter first, until the factorised layers hold
  `param_budget` of the target layers' original parameters.
- mode=rank: the same r everywhere; a rank a layer cannot have is an error before any work.

A layer is factorised only where that saves parameters; otherwise it stays dense. Targets
are components/model/projections.py's projections (Linear or GPT-2's Conv1D, read as out x in; `targets = []`
means every one inside the decoder blocks); a head tied to the embedding stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lmforge.components.compression.modules import LowRankLinear, set_module
from lmforge.components.compression.variant import load_parent, save_variant
from lmforge.components.errors import UserError
from lmforge.components.model.projections import Chosen, as_linear, choose_targets
from lmforge.components.sections.compression import LowRankConfig


@dataclass(frozen=True)
class Spectrum:
    name: str
    in_features: int
    out_features: int
    s: torch.Tensor  # singular values, descending

    @property
    def dense(self) -> int:
        return self.in_features * self.out_features

    def cost(self, rank: int) -> int:
        return rank * (self.in_features + self.out_features)


def choose_ranks(spectra: list[Spectrum], cfg: LowRankConfig) -> dict[str, int]:
    """name -> rank for the layers worth factorising (the others are left out: they stay dense)."""
    if cfg.mode == "rank":
        ranks = {sp.name: cfg.rank for sp in spectra}
    elif cfg.mode == "energy":
        ranks = {}
        for sp in spectra:
            share = (sp.s ** 2).cumsum(0) / (sp.s ** 2).sum()
            ranks[sp.name] = int((share < cfg.energy - 1e-7).sum()) + 1
    else:
        ranks = _budget_ranks(spectra, cfg.param_budget)
    by_name = {sp.name: sp for sp in spectra}
    return {n: r for n, r in ranks.items() if by_name[n].cost(r) < by_name[n].dense}


def _budget_ranks(spectra: list[Spectrum], fraction: float) -> dict[str, int]:
    budget = fraction * sum(sp.dense for sp in spectra)
    gains = []
    for k, sp in enumerate(spectra):
        share = (sp.s ** 2) / (sp.s ** 2).sum()
        gain = share / (sp.in_features + sp.out_features)
        gains += [(float(g), k) for g in gain]
    # Within a layer the gains fall with i, so taking the best gains overall takes a prefix of each layer.
    gains.sort(key=lambda t: -t[0])
    ranks = [1] * len(spectra)  # every factorised layer keeps at least its top direction
    spent = sum(sp.cost(1) for sp in spectra)
    taken = [0] * len(spectra)
    for _, k in gains:
        taken[k] += 1
        if taken[k] <= 1:
            continue
        step = spectra[k].in_features + spectra[k].out_features
        if spent + step > budget:
            continue
        spent += step
        ranks[k] = taken[k]
    return {sp.name: ranks[k] for k, sp in enumerate(spectra)}


def check_lowrank(model: torch.nn.Module, cfg: LowRankConfig, model_dir: object) -> Chosen:
    """The target projections, or a UserError when the config cannot apply to this model."""
    chosen = choose_targets(model, cfg.targets, key="compression.lowrank.targets", model_dir=model_dir)
    if cfg.mode == "rank" and chosen.targets:
        name, layer = min(chosen.targets.items(), key=lambda kv: min(kv[1].in_features, kv[1].out_features))
        limit = min(layer.in_features, layer.out_features)
        if cfg.rank > limit:
            raise UserError("compression.lowrank.rank", cfg.rank, f"is larger than layer {name} allows ({limit})",
                            f"Use a rank of at most {limit}, or mode = \"energy\" / \"budget\"")
    return chosen


def lowrank_variant(model_dir: Path, out_dir: Path, cfg: LowRankConfig) -> Path:
    model, parent = load_parent(model_dir)
    chosen = check_lowrank(model, cfg, model_dir)
    targets = chosen.targets
    # On the (out, in) view, so a Conv1D factorises exactly like a Linear and becomes a LowRankLinear.
    svds = {n: torch.linalg.svd(p.weight.detach().float(), full_matrices=False) for n, p in targets.items()}
    spectra = [Spectrum(n, p.in_features, p.out_features, svds[n][1]) for n, p in targets.items()]
    ranks = choose_ranks(spectra, cfg)
    retained = {}
    for name, rank in ranks.items():
        s = svds[name][1]
        retained[name] = round(float((s[:rank] ** 2).sum() / (s ** 2).sum()), 4)
        dense = targets[name].module if not targets[name].transposed else as_linear(targets[name].module)
        set_module(model, name, LowRankLinear.from_linear(dense, rank, svds[name]))
    before = sum(sp.dense for sp in spectra)
    after = sum(sp.cost(ranks[sp.name]) if sp.name in ranks else sp.dense for sp in spectra)
    recipe = {**cfg.model_dump(mode="json"), "ranks": ranks, "retained_energy": retained,
              "target_params": [before, after], "factorised_layers": len(ranks), "dense_layers": len(spectra) - len(ranks),
              "skipped": chosen.skipped}
    return save_variant(model, out_dir, parent_dir=parent, technique="lowrank-svd", recipe=recipe,
                        load={"kind": "lowrank", "ranks": ranks})
