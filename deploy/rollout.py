"""Gated rollout: a new version serves only after it loads and answers its validation prompts well, under a model
name that no user's request reaches.

    result = rollout(server_url, repo, cfg, version=4, build=lambda: build_version(..., stage=True),
                     promote=lambda v: set_production(v), request_log=ws.requests, journal=ws.triton / "rollouts.jsonl")
    result.serving          # [4]: the old version was unloaded only after the new one served
    result.promoted_at      # when requests that name no version began to reach it (the journal has it too)

Triton answers a request that names no version (the OpenAI gateway's, `lmforge generate`'s, a
user's tritonclient call) with the model's highest ready version, so a candidate loaded beside
the serving version would answer users before it passed. The gate therefore loads it as a model
of its own, `<model>-candidate` (repository.candidate_model), and the served model is touched
only once it has passed. In order:

1. Take out a candidate model a crashed rollout left behind.
2. Build the version folder in the staging area, outside the folder Triton polls; pre-flight it
   in this process (safetensors only, a short generation) so a broken export never reaches the
   server. A version whose folder is already in the repository (a rollback) is copied there.
3. Load it as `<model>-candidate` (the served model's config but for the name and the versions;
   the model enters the repository whole, in one rename) and wait (bounded) until Triton has
   loaded it.
4. Query it by that name and its version with its validation prompts (held-out prompts of its own
   task, written into the version folder when it was built: validation_prompts.json), one request
   each plus one batched request, checking that outputs are well formed and within the latency
   bound. The request log records these as the candidate model's, so monitoring never counts them.
5. The gate passed (`passed_at`): take the candidate model out whole and wait until Triton has
   unloaded it; rename its version folder into the served model and write a config naming the
   serving version and it; wait until both are ready. From then on a request that names no
   version gets the new (highest) one: the switch, `promoted_at` in the journal.
6. Write a config naming the new version alone and wait until it alone is ready: Triton unloads the
   old version once the requests it holds are answered, so no request fails at the switch. Only
   then `promote` (move the registry's `production` alias).

A refusal before the switch takes the candidate model out (and waits until Triton has unloaded
it); the served model was never touched. A failure after it (the final reload, the alias move)
writes the old config back and waits for it, then takes the new version's folder out. Either way
the reason is appended to the journal and RolloutRefused is raised: the alias stays where it was,
and the old version serves.

At most two copies are loaded at once: the serving version and the candidate, then the serving
version and the new one. Triton keeps a loaded version whose files and config are unchanged but
for the version policy and the instance group, which is where the repository writes its revision
(deploy/repository.py), so the serving version is never reloaded. The new version loads twice,
as the candidate and in the served model: `phases` in the journal gives each step's seconds.

Nothing here asks Triton to load anything: the server refuses load and unload requests
from every client (deploy/server.py); lmforge only writes the repository.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.serving import processing
from lmforge.components.serving.requestlog import now_iso
from lmforge.deploy import client
from lmforge.deploy.onnx_export import ONNX_FILE, is_onnx_dir
from lmforge.deploy.repository import (
    candidate_model,
    discard_staged,
    instance_kind,
    model_root,
    place_model,
    remove_model,
    remove_version,
    served_versions,
    stage_copy,
    staging_dir,
    take_version,
    version_dir,
    wait_served,
    write_and_wait,
)

DRAIN_WAIT_S = 30.0   # how long the last step waits for the old version to finish unloading before it goes on


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
    candidate: str = ""                 # the Triton model it was loaded and validated under
    passed_at: str | None = None        # it passed the gate: only after this did its folder enter the served model
    promoted_at: str | None = None      # the switch: requests that name no version reach it from here on
    phases: dict[str, float] = field(default_factory=dict)   # seconds of each step done: load, validate, switch, ...


def preflight(folder: Path, *, prompt: str) -> str | None:
    """Load the version's model the way the server will and generate two tokens; the problem, or None."""
    import torch

    from lmforge.components.registry.loading import load_causal_lm
    from lmforge.components.serving.task import Task

    try:
        task = Task.load(folder / "model")
        if is_onnx_dir(folder / "model"):  # an ONNX export: onnxruntime through the loop model.py runs it with
            from lmforge.components.serving import generation, modelload
            from lmforge.components.serving.onnxrun import OnnxForward

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
    if current == [version] and client.ready_versions(url, cfg.model_name).get(version):
        result = RolloutResult(version, current, current, True, f"version {version} already serving")
        return _record(journal, result, start)
    check_room(cfg)
    clear_candidate(url, repo, cfg)
    gate = _Gate(url, repo, cfg, version, current, request_log=request_log, journal=journal, start=start)
    prompts = gate.prepare(build)
    gate.load_candidate()
    gate.validate(prompts)
    gate.switch()
    gate.retire()
    return gate.promote(promote)


GPU_MEMORY_ROOM = 0.95   # of a GPU, what vLLM engines may take together (the rest: CUDA contexts, fragmentation)


def check_room(cfg: DeployConfig) -> None:
    """A rollout loads the candidate beside the serving version: on a GPU, vLLM's engines of both must fit. Refused
    before anything starts, naming what to set, when they cannot."""
    if cfg.engine != "vllm" or instance_kind(cfg) != "gpu" or 2 * cfg.gpu_memory_utilization <= GPU_MEMORY_ROOM:
        return
    raise UserError("deploy.gpu_memory_utilization", cfg.gpu_memory_utilization,
                    f"leaves no room for a rollout: the candidate's vLLM engines load beside the serving version's, "
                    f"2 x {cfg.gpu_memory_utilization} of each GPU > {GPU_MEMORY_ROOM}",
                    f"Set deploy.gpu_memory_utilization <= {GPU_MEMORY_ROOM / 2:.3f} (and kv_cache_tokens to what "
                    "that share holds)")


def clear_candidate(url: str, repo: Path, cfg: DeployConfig) -> None:
    """Take out the candidate model a crashed rollout left in the repository (or that the server still holds)."""
    name = candidate_model(cfg.model_name)
    if model_root(repo, name).exists() or client.ready_versions(url, name):
        _drop_candidate(url, repo, name, cfg.readiness_timeout_s)


def _drop_candidate(url: str, repo: Path, name: str, timeout: float) -> None:
    """Take candidate model `name` out of the repository; wait until Triton has unloaded what it had loaded of it
    (at once for one that failed to load: it holds nothing)."""
    remove_model(repo, name)
    client.wait_unloaded(url, name, model_root(repo, name), timeout=timeout)


class _Gate:
    """One rollout's steps and what each has changed, so that a refusal undoes exactly that."""

    def __init__(self, url: str, repo: Path, cfg: DeployConfig, version: int, current: list[int], *,
                 request_log: Path | None, journal: Path, start: float) -> None:
        self.url, self.repo, self.cfg, self.version, self.current = url, repo, cfg, version, current
        self.request_log, self.journal, self.start = request_log, journal, start
        self.candidate = cfg.model_copy(update={"model_name": candidate_model(cfg.model_name)})
        self.result = RolloutResult(version, current, current, False, "", candidate=self.candidate.model_name)
        self.staged: Path | None = None   # its folder in the staging area, in no model
        self.in_candidate = False         # the candidate model is in the repository
        self.placed = False               # its folder is in the served model's, put there by this rollout
        self.switched = False             # the served model's config names it
        self.both = sorted(set(current) | {version})
        self._mark = start

    def _phase(self, name: str) -> None:
        now = time.perf_counter()
        self.result.phases[name] = round(now - self._mark, 2)
        self._mark = now

    def prepare(self, build: Callable[[], Path] | None) -> list[str]:
        """Build (or find) the version's folder and pre-flight it; leave it in the staging area; its prompts."""
        folder = version_dir(self.repo, self.cfg.model_name, self.version)
        if build is not None and self.version not in self.current:
            folder = build()
            if folder.resolve().parent == staging_dir(self.repo).resolve():
                self.staged = folder
            else:   # built straight into the served model's folder (build_version without stage)
                self.placed = True
        if not (folder / "model.py").is_file():
            raise self.refuse(f"{folder} is not a built model version")
        try:
            prompts = processing.read_validation_prompts(folder, self.cfg.validation_prompts)
        except processing.BadRequest as e:
            raise self.refuse(str(e)) from None
        problem = preflight(folder, prompt=prompts[0])
        if problem:
            raise self.refuse(problem)
        if self.staged is None:   # its folder is in the served model's (a rollback): the candidate loads a copy
            self.staged = stage_copy(self.repo, self.cfg.model_name, self.version)
        self._phase("prepare")
        return prompts

    def load_candidate(self) -> None:
        """Load the version as the candidate model, whose name no request for the served model reaches."""
        place_model(self.repo, self.candidate, version=self.version, staged=self.staged, versions=[self.version],
                    request_log=self.request_log)
        self.staged, self.in_candidate = None, True
        try:
            wait_served(self.url, self.repo, self.candidate)
        except (client.RequestFailed, OSError) as e:
            raise self.refuse(f"Triton could not load it: {str(e).splitlines()[0][:300]}") from None
        self._phase("load")

    def validate(self, prompts: list[str]) -> None:
        problems, self.result.checks = validate(self.url, self.candidate, self.version, prompts)
        self._phase("validate")
        if problems:
            raise self.refuse("; ".join(problems[:3]))

    def switch(self) -> None:
        """The candidate model out and unloaded, then the version beside the serving one in the served model; once
        both are ready, a request that names no version gets the new one."""
        self.result.passed_at = now_iso()
        self.staged = take_version(self.repo, self.candidate.model_name, self.version)
        self.in_candidate = False
        try:   # unloaded before the second copy loads: never three copies in memory
            client.wait_unloaded(self.url, self.candidate.model_name, model_root(self.repo, self.candidate.model_name),
                                 timeout=self.cfg.readiness_timeout_s)
        except (client.RequestFailed, OSError) as e:
            raise self.refuse(f"Triton did not unload {self.candidate.model_name}: {str(e)[:300]}") from None
        if self.version in self.current:   # its folder already serves there: only the config changes
            discard_staged(self.repo, self.staged)
            settle = partial(write_and_wait, self.url, self.repo, self.cfg, versions=self.both,
                             request_log=self.request_log)
        else:
            place_model(self.repo, self.cfg, version=self.version, staged=self.staged, versions=self.both,
                        request_log=self.request_log)
            self.placed, settle = True, partial(wait_served, self.url, self.repo, self.cfg)
        self.staged, self.switched = None, True
        try:
            settle()
        except (client.RequestFailed, OSError) as e:
            raise self.refuse(f"Triton could not load it in {self.cfg.model_name!r}: "
                              f"{str(e).splitlines()[0][:300]}") from None
        self.result.promoted_at = now_iso()
        self._phase("switch")

    def retire(self) -> None:
        """The new version alone: Triton unloads the old one once it has answered the requests it holds."""
        if self.both == [self.version]:   # nothing served before: the config already names it alone
            return
        try:   # the new version alone serves; the old one may still be draining (it takes no new request)
            write_and_wait(self.url, self.repo, self.cfg, versions=[self.version], request_log=self.request_log,
                           draining_ok=True)
        except (client.RequestFailed, OSError) as e:
            raise self.refuse(f"the final reload failed: {str(e).splitlines()[0][:300]}") from None
        try:   # then, bounded, until it has unloaded (Triton 2.51 can keep one UNLOADING after malformed requests)
            wait_served(self.url, self.repo, self.cfg, timeout=min(DRAIN_WAIT_S, self.cfg.readiness_timeout_s))
        except (client.RequestFailed, OSError) as e:
            self.result.checks.append({"old_version_still_unloading": str(e).splitlines()[0][:200]})
        self._phase("retire")

    def promote(self, promote: Callable[[int], None]) -> RolloutResult:
        try:
            promote(self.version)
        except Exception as e:
            raise self.refuse(f"moving the production alias failed: {type(e).__name__}: {e}") from e
        self._phase("promote")
        self.result.serving, self.result.ok, self.result.reason = [self.version], True, "passed the gate"
        return _record(self.journal, self.result, self.start)

    def refuse(self, reason: str) -> RolloutRefused:
        """Undo what this rollout changed, record why it was refused, and say so."""
        try:
            self._undo()
        except (client.RequestFailed, OSError) as e:   # the refusal is still recorded, with what could not be undone
            reason = f"{reason}; undoing it failed: {str(e).splitlines()[0][:300]}"
        self.result.reason = reason
        _record(self.journal, self.result, self.start)
        keeps = f"version {self.current} keeps serving" if self.current else "nothing was serving"
        return RolloutRefused("deploy", f"version {self.version}", f"was refused: {reason}",
                              f"{keeps}; details in {self.journal}")

    def _undo(self) -> None:
        if self.staged is not None:
            discard_staged(self.repo, self.staged)
            self.staged = None
        if self.in_candidate:
            self.in_candidate = False
            _drop_candidate(self.url, self.repo, self.candidate.model_name, self.cfg.readiness_timeout_s)
        if self.switched:
            _restore(self.url, self.repo, self.cfg, self.current, self.request_log)
        # Its folder goes only after the restore: a load that reads it must not see it vanish.
        if self.placed and self.version not in self.current:
            if self.current:
                remove_version(self.repo, self.cfg.model_name, self.version)
            else:
                remove_model(self.repo, self.cfg.model_name)


def _restore(url: str, repo: Path, cfg: DeployConfig, current: list[int], request_log: Path | None) -> None:
    """Back to what served before: the old version never stopped serving; the new one is unloaded."""
    if current:
        write_and_wait(url, repo, cfg, versions=current, request_log=request_log)
    else:  # nothing served before: the model's folder goes, and Triton unloads whatever it had loaded of it
        remove_model(repo, cfg.model_name)
        client.wait_unloaded(url, cfg.model_name, model_root(repo, cfg.model_name), timeout=cfg.readiness_timeout_s)


def _record(journal: Path, result: RolloutResult, start: float) -> RolloutResult:
    result.seconds = round(time.perf_counter() - start, 2)
    journal.parent.mkdir(parents=True, exist_ok=True)
    with open(journal, "a", encoding="utf-8") as f:  # an append-only log: one line per attempt
        f.write(json.dumps({"at": now_iso(), **asdict(result)}) + "\n")
    return result
