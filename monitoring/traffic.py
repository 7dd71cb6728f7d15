"""Demo traffic: in-distribution and shifted prompts, sent through a caller-supplied client.

    prompts = normal_prompts(ws.dataset_dir(v) / "records" / "test.jsonl", n=200, seed=0)
    prompts = shifted_prompts(n=200, seed=0, noise=0.3, held_out=prompts)
    report = send_traffic(prompts, send, concurrency=4, refused=(RequestFailed,))

In-distribution prompts are held-out standard-library signatures (the dataset's test
split: modules training never saw, same kind of text). Shifted prompts mix three kinds
in equal parts: signatures of third-party packages from site-packages (different naming
and argument styles, longer), truncated signatures, and noisy ones with a share of
characters replaced by rare symbols. `send(prompt)` is one request; cli/commands/
monitor.py passes deploy/client.py's `generate` against the running Triton server, so
the demo traffic lands in the request log exactly as real traffic does.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.serving.records import read_records
from lmforge.components.serving.task import DEMO, Task

# Third-party packages whose signatures make the "unfamiliar code" part of the shifted traffic.
THIRD_PARTY = ("pydantic", "rich", "typer", "click", "requests", "pyarrow", "sqlalchemy", "fastapi", "mlflow",
               "transformers", "pandas", "urllib3", "jinja2", "yaml", "httpx", "starlette")
NOISE_CHARS = "ßøΩ≈ç√∫µ≤≥÷¡™£¢∞§¶•ªº≠œ∑®†¥¨πæ«»…¿‽☃✓"
MAX_SIGNATURE_CHARS = 400          # the serving limit refuses far longer prompts; demo traffic should be served


@dataclass
class TrafficReport:
    kind: str
    sent: int = 0
    ok: int = 0
    refused: int = 0
    seconds: float = 0.0
    refusals: list[str] = field(default_factory=list)   # the first few server messages

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "sent": self.sent, "ok": self.ok, "refused": self.refused,
                "seconds": round(self.seconds, 2), "requests_per_s": round(self.sent / self.seconds, 2)
                if self.seconds else None, "refusals": self.refusals}


def _sample(items: list[str], n: int, rng: random.Random) -> list[str]:
    if n <= len(items):
        return rng.sample(items, n)
    return [rng.choice(items) for _ in range(n)]


def normal_prompts(records_path: Path, *, n: int, seed: int, task: Task = DEMO) -> list[str]:
    """n held-out prompts of the task from a records JSONL, as a client sends them (sampled with replacement when
    there are fewer)."""
    path = Path(records_path)
    if not path.is_file():
        raise UserError("dataset records", path, "do not exist", "Run the data stage first: lmforge run data")
    prompts = [task.prompt_as_text(ex[0]) for r in read_records(path) if (ex := task.example(r)) is not None]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise UserError("dataset records", path, f"hold no prompts of the {task.kind} task",
                        "Re-run the data stage (lmforge run data) or set task.kind")
    return _sample(prompts, n, random.Random(seed))


def _signature(node: ast.AST) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
        return f"{prefix} {node.name}({ast.unparse(node.args)}){ret}:"
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        return f"class {node.name}({bases}):" if bases else f"class {node.name}:"
    return None


def third_party_signatures(*, limit: int, seed: int, packages: tuple[str, ...] = THIRD_PARTY) -> list[str]:
    """Up to `limit` signatures of public functions/classes parsed (never imported) from site-packages."""
    root = Path(sysconfig.get_paths()["purelib"])
    files = sorted(p for pkg in packages if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py"))
    rng = random.Random(seed)
    rng.shuffle(files)
    out: list[str] = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a vendored file for another Python version: not needed for a demo sample
        for node in ast.walk(tree):
            sig = _signature(node)
            if sig and not getattr(node, "name", "_").startswith("_") and len(sig) <= MAX_SIGNATURE_CHARS:
                out.append(sig)
        if len(out) >= limit:
            break
    if not out:
        raise UserError("site-packages", root, f"has none of the packages {', '.join(packages)}",
                        "Install lmforge's dependencies into this environment (make bootstrap)")
    return out[:limit]


def truncate(prompt: str, rng: random.Random) -> str:
    """Cut a signature to 20-50% of its length (never empty)."""
    keep = max(1, int(len(prompt) * rng.uniform(0.2, 0.5)))
    return prompt[:keep]


def add_noise(prompt: str, share: float, rng: random.Random) -> str:
    """Replace `share` of the characters with rare symbols."""
    chars = list(prompt)
    for i in rng.sample(range(len(chars)), max(1, int(len(chars) * share))):
        chars[i] = rng.choice(NOISE_CHARS)
    return "".join(chars)


def shifted_prompts(*, n: int, seed: int, noise: float, held_out: list[str]) -> list[str]:
    """n prompts: a third from site-packages, a third truncated and a third noisy versions of `held_out`."""
    rng = random.Random(seed)
    n_third = n - 2 * (n // 3)
    third = _sample(third_party_signatures(limit=max(4 * n_third, 50), seed=seed), n_third, rng)
    truncated = [truncate(p, rng) for p in _sample(held_out, n // 3, rng)]
    noisy = [add_noise(p, noise, rng) for p in _sample(held_out, n // 3, rng)]
    prompts = third + truncated + noisy
    rng.shuffle(prompts)
    return prompts


def send_traffic(prompts: list[str], send: Callable[[str], Any], *, kind: str, concurrency: int = 4,
                 refused: tuple[type[BaseException], ...] = ()) -> TrafficReport:
    """Send each prompt as one request, `concurrency` at a time; refusals are counted, other errors raise."""
    report = TrafficReport(kind=kind)

    def one(prompt: str) -> str | None:
        try:
            send(prompt)
            return None
        except refused as e:
            return str(e)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for message in pool.map(one, prompts):
            report.sent += 1
            if message is None:
                report.ok += 1
            else:
                report.refused += 1
                if len(report.refusals) < 5:
                    report.refusals.append(message)
    report.seconds = time.perf_counter() - start
    return report
