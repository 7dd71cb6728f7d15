"""Stages that start from a registry alias are skipped, with the reason, when the gate promoted nothing."""

from lmforge.cli.summary import headline
from lmforge.components.config import load_config
from lmforge.flows.pipeline import missing_model


def test_compress_and_deploy_skip_without_a_champion(workspace, tiny_config):
    for stage in ("compress", "deploy"):
        reason = missing_model(workspace, tiny_config, stage)
        assert reason is not None and "skipped" in reason and "@champion" in reason
        assert headline(stage, {"summary": reason}) == reason
    assert missing_model(workspace, tiny_config, "train") is None


def test_a_held_alias_lets_the_stage_run(workspace, tiny_config, tiny_model_dir):
    from lmforge.components.registry.aliases import set_alias
    from lmforge.components.registry.store import register_model

    version = register_model(workspace, tiny_config.registry, tiny_model_dir, metrics={"bpc": 3.0}, tags={})
    set_alias(workspace, tiny_config.registry.model_name, "champion", version, reason="test")
    assert missing_model(workspace, tiny_config, "deploy") is None
    cfg = load_config(None, ["deploy.alias=compressed"])
    assert "@compressed" in missing_model(workspace, cfg.model_copy(update={"registry": tiny_config.registry}), "deploy")
