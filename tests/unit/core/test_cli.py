"""CLI conventions: errors on stderr in one line, exit codes 0/1/2, --debug anywhere, --version, choices in help."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def lmforge(*args, env_home, cwd=None, **env):
    full_env = {**os.environ, "LMFORGE_HOME": str(env_home), **env}
    return subprocess.run([sys.executable, "-m", "lmforge.cli", *args], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=120)


def test_bad_override_is_one_line_on_stderr_exit_2(tmp_path):
    r = lmforge("run", "data", "--set", "data.max_docs=zero", env_home=tmp_path)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data.max_docs"), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("where", ["first", "last"])
def test_debug_anywhere_shows_the_traceback(tmp_path, where):
    args = ["run", "data", "--set", "data.max_docs=zero"]
    args = ["--debug", *args] if where == "first" else [*args, "--debug"]
    r = lmforge(*args, env_home=tmp_path)
    assert r.returncode == 2 and "Traceback" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: data.max_docs")


def test_unknown_stage_is_a_usage_error_listing_the_stages(tmp_path):
    r = lmforge("run", "nosuchstage", env_home=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: ") and "'data'" in r.stderr and "'all'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_unknown_option_is_exit_2_on_stderr(tmp_path):
    r = lmforge("status", "--no-such-option", env_home=tmp_path)
    assert r.returncode == 2 and r.stdout == "" and "--no-such-option" in r.stderr


def test_a_failure_that_is_not_a_user_error_is_one_line_exit_1(tmp_path):
    """`lmforge prefect deploy` against a server that is not there: the work fails, without a traceback."""
    from lmforge.components.runtime import supervisor

    ws = tmp_path / "ws"
    (ws / "prefect").mkdir(parents=True)
    # A server record for this very test process: "up" as far as lmforge can tell, but no API answers there.
    supervisor.save(supervisor.record(os.getpid()), ws / "prefect" / "server.json",
                    api_url="http://127.0.0.1:9/api", ui_url="http://127.0.0.1:9")
    r = lmforge("prefect", "deploy", env_home=ws)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")


def test_version(tmp_path):
    from importlib.metadata import version

    r = lmforge("--version", env_home=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"lmforge {version('lmforge')}"


def test_help_lists_the_choices_and_every_option_has_help(tmp_path):
    run_help = lmforge("run", "--help", env_home=tmp_path, COLUMNS="200").stdout
    assert "data" in run_help and "monitor" in run_help and "all" in run_help
    plan_help = lmforge("plan", "--help", env_home=tmp_path, COLUMNS="200").stdout
    assert "bf16" in plan_help and "fp32" in plan_help


def test_every_option_of_every_command_has_help_text():
    import typer.main

    from lmforge.cli import cli

    cli._mount_groups()
    root = typer.main.get_command(cli.app)
    missing = []

    def walk(cmd, path):
        for p in cmd.params:
            if p.param_type_name == "option" and not (getattr(p, "help", None) or "").strip():
                missing.append(f"{path} {p.opts[0]}")
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(root, "lmforge")
    assert not missing, missing


def test_stage_choices_are_the_pipeline_stages():
    from lmforge.cli.cli import Stage
    from lmforge.components.stages import STAGES

    assert [s.value for s in Stage] == [*STAGES, "all"]


def test_new_command_modules_are_mounted_without_a_list():
    from lmforge.cli.cli import command_modules

    names = command_modules()
    assert {"plan", "prefect", "registry", "serve", "monitor"} <= set(names)
    assert not [n for n in names if n.startswith("_")]


def test_status_on_an_empty_workspace(tmp_path):
    r = lmforge("status", env_home=tmp_path)
    assert r.returncode == 0 and "datasets: none" in r.stdout


def test_help_and_status_write_nothing_to_the_current_folder(tmp_path):
    """No command writes to the current folder unless it runs work there (the workspace defaults to ./.lmforge)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LMFORGE_"))}
    env["HOME"] = str(tmp_path / "home")   # no user Prefect profile: the embedded mode
    cwd = tmp_path / "empty"
    cwd.mkdir()
    for args in (["--help"], ["status"], ["prefect", "status"], ["plan", "--model", "1b"]):
        r = subprocess.run([sys.executable, "-m", "lmforge.cli", *args], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (args, r.stderr)
        assert list(cwd.iterdir()) == [], (args, list(cwd.iterdir()))
