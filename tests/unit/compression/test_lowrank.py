import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from lmforge.components.compression.lowrank import Spectrum, choose_ranks, lowrank_variant
from lmforge.components.compression.modules import LowRankLinear
from lmforge.components.compression.variant import load_variant, read_meta
from lmforge.components.errors import UserError
from lmforge.components.sections.compression import LowRankConfig

from ._util import logits


@pytest.mark.parametrize("rank", [1, 5, 20])
def test_factorised_layer_error_is_bounded_by_the_discarded_singular_values(rank):
    torch.manual_seed(0)
    linear = nn.Linear(48, 32)
    s = torch.linalg.svdvals(linear.weight.detach())
    layer = LowRankLinear.from_linear(linear, rank)
    x = torch.randn(256, 48)
    with torch.no_grad():
        err = (linear(x) - layer(x)).norm(dim=1)
        w_r = layer.up.weight @ layer.down.weight
    assert (err <= s[rank] * x.norm(dim=1) * (1 + 1e-4) + 1e-5).all()  # spectral bound, every input
    frob = (linear.weight.detach() - w_r).norm()
    assert frob == pytest.approx(float(s[rank:].pow(2).sum().sqrt()), rel=1e-3)  # Eckart-Young, Frobenius
    assert err.max() > 0  # a truncation really happened
    assert layer.down.weight.shape == (rank, 48) and layer.up.weight.shape == (32, rank)


def _spectra():
    torch.manual_seed(0)
    return [Spectrum(f"l{i}", 64, 64,
                     torch.linalg.svdvals(torch.randn(64, 64) * (i + 1) @ torch.diag(torch.linspace(1, 0.01, 64))))
            for i in range(3)]


def test_energy_mode_keeps_the_smallest_rank_reaching_the_energy():
    for sp, (_name, r) in zip(_spectra(), choose_ranks(_spectra(), LowRankConfig(mode="energy", energy=0.8)).items()):
        share = (sp.s ** 2).cumsum(0) / (sp.s ** 2).sum()
        assert share[r - 1] >= 0.8 - 1e-6 and (r == 1 or share[r - 2] < 0.8)


def test_budget_mode_stays_within_the_parameter_budget():
    spectra = _spectra()
    ranks = choose_ranks(spectra, LowRankConfig(mode="budget", param_budget=0.3))
    used = sum(sp.cost(ranks[sp.name]) if sp.name in ranks else sp.dense for sp in spectra)
    dense = sum(sp.dense for sp in spectra)
    assert 0.2 * dense < used <= 0.3 * dense


def test_lowrank_variant_saves_loads_and_meets_the_budget(tiny_model_dir, tmp_path, ids):
    out = lowrank_variant(tiny_model_dir, tmp_path / "lr", LowRankConfig(mode="budget", param_budget=0.5))
    meta = read_meta(out)
    before, after = meta["recipe"]["target_params"]
    assert after <= 0.5 * before
    with pytest.raises(ValueError, match="lmforge_lowrank"):  # a plain load fails loudly, never random weights
        AutoModelForCausalLM.from_pretrained(out)
    model = load_variant(out)
    assert isinstance(model.get_submodule(next(iter(meta["load"]["ranks"]))), LowRankLinear)
    # Reloading twice gives the same model: the factors, not a random init, are what is stored.
    assert torch.equal(logits(model, ids), logits(load_variant(out), ids))
    parent = load_variant(tiny_model_dir)
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in parent.parameters())


def test_full_energy_reproduces_the_parent(tiny_model_dir, tmp_path, ids):
    # Rank = full where that still saves parameters: here no layer is worth factorising at energy 1.
    out = lowrank_variant(tiny_model_dir, tmp_path / "lr", LowRankConfig(mode="energy", energy=1.0))
    assert torch.allclose(logits(load_variant(out), ids), logits(load_variant(tiny_model_dir), ids), atol=1e-4)


def test_rank_larger_than_a_layer_allows_is_refused_before_any_work(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match=r"compression.lowrank.rank: 65 is larger than layer .* allows \(64\)"):
        lowrank_variant(tiny_model_dir, tmp_path / "lr", LowRankConfig(mode="rank", rank=65))
    assert not (tmp_path / "lr").exists()


def test_targets_matching_nothing_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match="match no Linear layer"):
        lowrank_variant(tiny_model_dir, tmp_path / "lr", LowRankConfig(targets=["no_such_proj"]))
