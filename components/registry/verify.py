"""Check, before registering, that a model folder loads and generates the same everywhere it will run.

    problem = verify_servable(variant_dir, serve_python=Path(".venv-serve/bin/python"))
    if problem:                          # "MLflow pyfunc: ... " / "serving runtime: ..." / "... differ ..."
        print("not registered:", problem)

Three loads of the same folder generate greedily for the same fixed prompts:
1. lmforge itself (components/registry/loading.py), as evaluation scores it;
2. the MLflow model `register_model` would log, saved to a temporary folder and loaded
   with `mlflow.pyfunc.load_model` (its own stored `lmforge_serving/`);
3. the serving environment's Python (.venv-serve: Triton's interpreter, numpy<2) running
   the `lmforge_serving/` package Triton's model.py imports, without lmforge installed.
The folder passes when all three load and give token-identical outputs; otherwise the
first problem is returned, in one line, for the caller to record.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

PROMPTS = ("def dumps(obj, *, skipkeys=False, ensure_ascii=True, indent=None):", "def join(a, *p):",
           "class OrderedDict(dict):")

_SERVE_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from lmforge_serving import generation, modelload, task
assert not [m for m in sys.modules if m.startswith("lmforge.")], "lmforge itself must not be needed"
model, tok, t = modelload.load_model(sys.argv[2]), modelload.load_tokenizer(sys.argv[2]), task.Task.load(sys.argv[2])
prompts = json.loads(sys.argv[3])
stops, ends = t.stops(tok)
outs = generation.generate(model, tok, [t.encode(tok, p) for p in prompts], max_new_tokens=int(sys.argv[4]),
                           stop_strings=stops, ends=ends)
print(json.dumps([list(o.token_ids) for o in outs]))
"""


def verify_servable(model_dir: Path, *, serve_python: Path | None, prompts: Sequence[str] = PROMPTS,
                    max_new_tokens: int = 8, timeout_s: float = 300.0) -> str | None:
    """None when lmforge, the MLflow pyfunc and the serving runtime load `model_dir` and agree; else why not."""
    from lmforge.components import serving
    from lmforge.components.registry.loading import load_causal_lm
    from lmforge.components.serving import generation
    from lmforge.components.serving.task import Task

    model_dir = Path(model_dir).resolve()
    try:
        model, tok = load_causal_lm(model_dir)
        task = Task.load(model_dir)
        stops, ends = task.stops(tok)
        expected = [list(o.token_ids) for o in generation.generate(
            model, tok, [task.encode(tok, p) for p in prompts], max_new_tokens=max_new_tokens,
            stop_strings=stops, ends=ends)]
    except Exception as e:  # the finding itself
        return f"lmforge cannot load it: {_one_line(e)}"
    del model

    pyfunc = _pyfunc_tokens(model_dir, prompts, max_new_tokens)
    if isinstance(pyfunc, str):
        return f"MLflow pyfunc: {pyfunc}"
    if pyfunc != expected:
        return f"MLflow pyfunc tokens differ from lmforge's: {pyfunc[0][:8]} vs {expected[0][:8]}"

    if serve_python is None:
        return
    if not Path(serve_python).is_file():
        return f"serving runtime: no Python at {serve_python} (run scripts/bootstrap.sh or set LMFORGE_SERVE_VENV)"
    with tempfile.TemporaryDirectory() as tmp:
        serving.copy_whole(Path(tmp))
        try:
            done = subprocess.run([str(serve_python), "-I", "-c", _SERVE_SCRIPT, tmp, str(model_dir), json.dumps(list(prompts)),
                                   str(max_new_tokens)], capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"serving runtime: no answer within {timeout_s:.0f} s"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return f"serving runtime ({serve_python}) cannot load it: {lines[-1] if lines else 'exit ' + str(done.returncode)}"
    served = json.loads(done.stdout.strip().splitlines()[-1])
    if served != expected:
        return f"serving runtime tokens differ from lmforge's: {served[0][:8]} vs {expected[0][:8]}"
    return


def _pyfunc_tokens(model_dir: Path, prompts: Sequence[str], max_new_tokens: int) -> list[list[int]] | str:
    import mlflow.pyfunc

    from lmforge.components.registry.store import save_pyfunc

    with tempfile.TemporaryDirectory() as tmp:
        try:
            saved = save_pyfunc(model_dir, Path(tmp) / "model")
            loaded = mlflow.pyfunc.load_model(str(saved))
            rows = loaded.predict(list(prompts), params={"max_new_tokens": max_new_tokens, "output": "token_ids"})
        except Exception as e:  # the finding itself
            return f"cannot load or run it: {_one_line(e)}"
    return [[int(t) for t in str(r).split()] for r in rows]


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
