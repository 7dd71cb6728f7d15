"""Gated rollout: a new version serves only after it loads and answers its validation prompts well.

    result = rollout(server_url, repo, cfg, version=4, build=lambda: build_version(..., stage=True),
                     promote=lambda v: set_production(v), request_log=ws.requests, journal=ws.triton / "rollouts.jsonl")
    result.serving          # [4]: the old version was unloaded only after the gate passed

The gate, in order: build the version folder in the staging area, outside the folder
Triton polls; pre-flight it in this process (safetensors only, a short generation) so a
broken export never reaches the server; rename it into the repository and write a
config.pbtxt naming it beside the serving version, then wait (bounded) until Triton,
which polls the repository, has loaded both; query it with its validation prompts (held-out
prompts of its own task, written into the version folder when it was built:
validation_prompts.json), one request each plus one batched request, checking that outputs are well formed and within
the latency bound; write a config naming only the new version and wait until it alone
is ready (Triton unloads the old one once the new config has loaded); only then
`promote` (move the registry's `production` alias). On any failure, the final reload
and the alias move included, the config goes back to the old version and Triton is
waited for, the candidate's folder is taken out, the reason is appended to the journal,
and RolloutRefused is raised: the alias stays where it was, and the old version serves.

Nothing here asks Triton to load anything: the server refuses load and unload requests
from every client (deploy/server.py); lmforge only writes the repository.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.onnx_export import ONNX_FILE, is_onnx_dir
from lmforge.components.requestlog import now_iso
from lmforge.components.sections.deploy import DeployConfig
from lmforge.deploy import client, processing
from lmforge.deploy.repository import (
    discard_staged,
    place_version,
    remove_model,
    remove_version,
    served_versions,
    version_dir,
    write_config,
)


class RolloutRefused(UserError):
    """The candidate failed the gate; the previously serving version still serves."""


@dataclass
class RolloutResult:
    version: int
    previous: list[int]
    serving: list[int]
    ok: bool
    reason: str
    checks: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def preflight(folder: Path, *, prompt: str) -> str | None:
    """Load the version's model the way the server will and generate two tokens; the problem, or None."""
    import torch

    from lmforge.components.registry.loading import load_causal_lm
    from lmforge.components.task import Task

    try:
        task = Task.load(folder / "model")
        if is_onnx_dir(folder / "model"):  # an ONNX export: onnxruntime through the loop model.py runs it with
            from lmforge.components import generation
            from lmforge.components.model import modelload
            from lmforge.components.model.onnxrun import OnnxForward

            tok = modelload.load_tokenizer(folder / "model")
            # The graph must load and run the prefill and a cached step (an eos first ends sooner: a valid answer).
            generation.decode(OnnxForward(folder / "model" / ONNX_FILE), tok,
                              [task.encode(tok, task.parse_prompt(prompt))], max_new_tokens=2, stop_strings=())
            return None
        model, tok = load_causal_lm(folder / "model")
        ids = {"input_ids": torch.tensor([task.encode(tok, task.parse_prompt(prompt))])}
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
        if out.shape[1] <= ids["input_ids"].shape[1]:
            return "pre-flight generated no tokens"
    except Exception as e:  # any failure to load or run is the finding, reported verbatim
        return f"pre-flight failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return None


def validate(url: str, cfg: DeployConfig, version: int, prompts: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """Query `version` with its validation prompts, each streamed (generate_stream), then all at once; (problems,
    per-request checks)."""
    problems, checks = [], []
    timeout = max(cfg.validation_latency_ms / 1e3 * 2, 10.0)
    batches = [[p] for p in prompts] + ([prompts] if len(prompts) > 1 else [])
    for batch in batches:
        try:
            if len(batch) == 1:
                gen, pieces = client.stream_endpoint_generate(url, batch[0], model=cfg.model_name, version=version,
                                                              timeout=timeout)
                gens = [gen]
            else:
                gens, pieces = client.generate(url, batch, model=cfg.model_name, version=version, timeout=timeout), []
        except (client.RequestFailed, OSError) as e:
            problems.append(f"request for {batch[0]!r} failed: {e}")
            checks.append({"prompts": len(batch), "error": str(e)})
            continue
        latency = max(g.latency_ms for g in gens)
        check = {"prompts": len(batch), "latency_ms": round(latency, 1), "text_output": gens[0].text[:80]}
        if len(batch) == 1:
            check["streamed_pieces"] = len(pieces)
        if len(gens) != len(batch):
            problems.append(f"{len(batch)} prompts got {len(gens)} answers")
        if latency > cfg.validation_latency_ms:
            problems.append(f"latency {latency:.0f} ms for {len(batch)} prompt(s) exceeds the bound "
                            f"{cfg.validation_latency_ms:.0f} ms")
        for g in gens:
            why = processing.is_well_formed(g.as_result())
            if why:
                problems.append(f"malformed output for {batch[0]!r}: {why}")
        checks.append(check)
    return problems, checks


def rollout(url: str, repo: Path, cfg: DeployConfig, *, version: int, build: Callable[[], Path] | None,
            promote: Callable[[int], None], request_log: Path | None, journal: Path) -> RolloutResult:
    """Serve `version` if it passes the gate; otherwise keep what serves and raise RolloutRefused."""
    start = time.perf_counter()
    current = served_versions(repo, cfg.model_name)
    ready = client.ready_versions(url, cfg.model_name)
    if current == [version] and ready.get(version):
        result = RolloutResult(version, current, current, True, f"version {version} already serving")
        return _record(journal, result, start)

    staged: Path | None = None  # a built folder not yet in the repository

    def refuse(reason: str, checks: list[dict[str, Any]] | None = None, *, loaded: bool) -> RolloutRefused:
        if loaded:
            _restore(url, repo, cfg, current, request_log)
        if staged is not None:
            discard_staged(repo, staged)
        if version not in current:
            remove_version(repo, cfg.model_name, version)
        result = RolloutResult(version, current, current, False, reason, checks or [])
        _record(journal, result, start)
        keeps = f"version {current} keeps serving" if current else "nothing was serving"
        return RolloutRefused("deploy", f"version {version}", f"was refused: {reason}",
                              f"{keeps}; details in {journal}")

    folder = version_dir(repo, cfg.model_name, version)
    if build is not None and version not in current:
        folder = build()
        staged = folder if folder != version_dir(repo, cfg.model_name, version) else None
    if not (folder / "model.py").is_file():
        raise refuse(f"{folder} is not a built model version", loaded=False)
    # Checked before it enters the repository: Triton reloads the model whenever its folder changes.
    try:
        prompts = processing.read_validation_prompts(folder, cfg.validation_prompts)
    except processing.BadRequest as e:
        raise refuse(str(e), loaded=False) from None
    problem = preflight(folder, prompt=prompts[0])
    if problem:
        raise refuse(problem, loaded=False)
    if staged is not None:
        place_version(repo, cfg.model_name, version, staged)
        staged = None

    both = sorted(set(current) | {version})
    revision = write_config(repo, cfg, versions=both, request_log=request_log)
    try:
        client.wait_versions(url, cfg.model_name, both, revision=revision, timeout=cfg.readiness_timeout_s)
    except (client.RequestFailed, OSError) as e:
        raise refuse(f"Triton could not load it: {str(e).splitlines()[0][:300]}", loaded=True) from None

    problems, checks = validate(url, cfg, version, prompts)
    if problems:
        raise refuse("; ".join(problems[:3]), checks, loaded=True)

    # The final reload serves the new version alone; only once it is ready does `production` move.
    # (With nothing served before, the config already names it alone: reloading it would only cost time.)
    if both != [version]:
        revision = write_config(repo, cfg, versions=[version], request_log=request_log)
        try:  # Triton unloads the old version once the new config has loaded
            client.wait_versions(url, cfg.model_name, [version], revision=revision, timeout=cfg.readiness_timeout_s)
        except (client.RequestFailed, OSError) as e:
            raise refuse(f"the final reload failed: {str(e).splitlines()[0][:300]}", checks, loaded=True) from None
    try:
        promote(version)
    except Exception as e:
        raise refuse(f"moving the production alias failed: {type(e).__name__}: {e}", checks, loaded=True) from e
    result = RolloutResult(version, current, [version], True, "passed the gate", checks)
    return _record(journal, result, start)


def _restore(url: str, repo: Path, cfg: DeployConfig, current: list[int], request_log: Path | None) -> None:
    """Back to what served before: the old version never stopped serving; the candidate is unloaded."""
    if current:
        revision = write_config(repo, cfg, versions=current, request_log=request_log)
        # The candidate's folder goes only after this (refuse): a load that reads it must not see it vanish.
        client.wait_versions(url, cfg.model_name, current, revision=revision, timeout=cfg.readiness_timeout_s)
    else:  # nothing served before: the model's folder goes, and Triton unloads whatever it had loaded of it
        remove_model(repo, cfg.model_name)
        client.wait_versions(url, cfg.model_name, [], revision=None, timeout=cfg.readiness_timeout_s)


def _record(journal: Path, result: RolloutResult, start: float) -> RolloutResult:
    result.seconds = round(time.perf_counter() - start, 2)
    journal.parent.mkdir(parents=True, exist_ok=True)
    with open(journal, "a", encoding="utf-8") as f:  # an append-only log: one line per attempt
        f.write(json.dumps({"at": now_iso(), **asdict(result)}) + "\n")
    return result
