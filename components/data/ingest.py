"""Read the raw corpus: the built-in docstring corpus or a user's files, as `RawItem`s.

    check_source(cfg.source)                      # UserError now if the path is missing or unreadable
    for path in corpus_files(cfg): ...             # the files the source holds (readers.py cuts them into shards)
    source_fingerprint(cfg)                        # changes exactly when the input changes

The built-in corpus is the docstrings of the installed standard library (optionally
site-packages too), read with `ast` from the source files: no module is ever imported.
User sources are JSONL, Parquet, CSV, or a folder of .txt files. Nothing is judged here:
a line that is not UTF-8 or not JSON is passed on as raw bytes, and `validate` decides.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.sections.data import DataConfig
from lmforge.components.workspace import sha256_tree

JSONL_SUFFIXES = (".jsonl", ".ndjson")
SUPPORTED = "a JSONL/Parquet/CSV file or a folder of .txt files"
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
NEVER_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})

Progress = Callable[[int], None]


@dataclass(frozen=True)
class RawItem:
    """One unjudged input unit. `kind` is "docstring" (built-in corpus) or "document" (user files).

    `raw` is the unit exactly as read (what the quarantine keeps); `source`/`line` say where it was;
    `error` is (reason, detail) when the reader already knows the unit is bad (a blank line, a
    CSV row with the wrong number of cells, a .py file that does not parse).
    """

    origin: str
    payload: bytes | dict[str, Any]
    mtime: float
    kind: str = "document"
    source: str = ""
    line: int | None = None
    format: str = "jsonl"
    raw: bytes = b""
    meta: dict[str, Any] = field(default_factory=dict)
    error: tuple[str, str] | None = None


# --- the source ------------------------------------------------------------------

def check_source(source: str | None) -> Path | None:
    """The user's source as a Path (None = built-in corpus); a UserError if it cannot be read."""
    if source is None:
        return None
    path = Path(source).expanduser()
    fix = f"Point it at {SUPPORTED}, or remove it to use the built-in corpus"
    if not path.exists():
        raise UserError("data.source", source, "does not exist", fix)
    if not os.access(path, os.R_OK):
        raise UserError("data.source", source, "is not readable by this user",
                        "Fix its permissions or copy it somewhere readable")
    if path.is_dir():
        if not any(path.rglob("*.txt")):
            raise UserError("data.source", source, "is a folder with no .txt files", fix)
    elif path.suffix.lower() not in (*JSONL_SUFFIXES, ".parquet", ".csv"):
        raise UserError("data.source", source, f"has an unsupported type {path.suffix or '(no suffix)'!r}", fix)
    return path.resolve()


def corpus_roots(include_site_packages: bool) -> list[tuple[str, Path]]:
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]))]
    if include_site_packages:
        roots.append(("site-packages", Path(paths["purelib"])))
        if paths["platlib"] != paths["purelib"]:
            roots.append(("site-packages", Path(paths["platlib"])))
    return roots


def corpus_files(include_site_packages: bool, skip_tests: bool) -> list[tuple[str, Path, str]]:
    """(source, root, relative path) of every .py file of the built-in corpus, in a stable order."""
    skip = NEVER_DIRS | (TEST_DIRS if skip_tests else frozenset())
    out = []
    for source, root in corpus_roots(include_site_packages):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.endswith((".dist-info", ".egg-info")))
            rel_dir = Path(dirpath).relative_to(root)
            out += [(source, root, (rel_dir / f).as_posix()) for f in sorted(filenames) if f.endswith(".py")]
    return out


def source_fingerprint(cfg: DataConfig) -> str:
    """A hash that changes when the input changes: file contents for user sources, file stats for the corpus."""
    path = check_source(cfg.source)
    if path is not None:
        return sha256_tree(path)
    h = hashlib.sha256(f"{sys.version}|{cfg.include_site_packages}|{cfg.skip_tests}".encode())
    for source, root, rel in corpus_files(cfg.include_site_packages, cfg.skip_tests):
        st = (root / rel).stat()
        h.update(f"{source}/{rel}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


# --- the built-in corpus -----------------------------------------------------------

def module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def signature_of(node: ast.AST, module: str) -> str:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
        prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:"
    if isinstance(node, ast.ClassDef):
        bases = [ast.unparse(b) for b in node.bases] + [ast.unparse(k) for k in node.keywords]
        return f"class {node.name}({', '.join(bases)}):" if bases else f"class {node.name}:"
    return f"module {module}:"


def extract_docstrings(source_bytes: bytes, *, source: str, module: str) -> list[dict[str, str]]:
    """Every docstring of a module's source (module, classes, functions, nested ones) as record fields."""
    tree = ast.parse(source_bytes)
    out: list[dict[str, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = prefix + child.name
                add(child, qualname)
                inner = ".<locals>." if not isinstance(child, ast.ClassDef) else "."
                visit(child, qualname + inner)
            elif isinstance(child, ast.stmt):
                visit(child, prefix)  # defs under if/try/with at any level

    def add(node: ast.AST, qualname: str) -> None:
        doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
        if doc is not None:
            out.append({"source": source, "module": module, "qualname": qualname,
                        "signature": signature_of(node, module), "docstring": doc, "lineno": getattr(node, "lineno", 1)})

    add(tree, "")
    visit(tree, "")
    return out


def extract_file(job: tuple[str, str, str]) -> tuple[list[dict[str, Any]], float, str | None, bytes]:
    """(docstrings, mtime, error, the file's bytes when it could not be parsed) of one corpus file."""
    source, root, rel = job
    path = Path(root) / rel
    data = b""
    try:
        data, mtime = path.read_bytes(), path.stat().st_mtime
        return extract_docstrings(data, source=source, module=module_name(rel)), mtime, None, b""
    except (SyntaxError, ValueError, OSError, RecursionError) as e:  # Python 2 files, odd encodings
        return [], 0.0, f"{type(e).__name__}: {e}", data


def _extract_file(job: tuple[str, str, str]) -> tuple[list[dict[str, Any]], float, str | None]:
    return extract_file(job)[:3]


def iter_corpus(cfg: DataConfig, *, progress: Progress | None = None, report: dict[str, Any]) -> Iterator[RawItem]:
    jobs = [(s, str(root), rel) for s, root, rel in corpus_files(cfg.include_site_packages, cfg.skip_tests)]
    report.update(files=len(jobs), unparseable_files=0, unparseable_examples=[])
    if cfg.workers > 1 and len(jobs) > 64:
        # fork, not spawn: spawn re-runs an unguarded __main__ script in every worker. The workers
        # only parse files with a pure function, so the parent's threads (Prefect's) do not matter.
        pool = ProcessPoolExecutor(cfg.workers, mp_context=get_context("fork"))
        results = pool.map(_extract_file, jobs, chunksize=32)
    else:
        pool, results = None, map(_extract_file, jobs)
    try:
        for (source, _root, rel), (docs, mtime, error) in zip(jobs, results):
            if error is not None:
                report["unparseable_files"] += 1
                if len(report["unparseable_examples"]) < 20:
                    report["unparseable_examples"].append(f"{source}:{rel}: {error}")
            for d in docs:
                yield RawItem(f"{source}:{rel}:{d['qualname'] or '<module>'}", d, mtime, kind="docstring")
            if progress:
                progress(1)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
