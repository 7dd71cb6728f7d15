"""Triton's environment is an allowlist (deploy/server.py): a credential in any variable's value never reaches it.

That no credential reaches a real server is checked where it lives: credentials planted in the caller's environment
are looked for in the running Triton server's and its model stubs' /proc/<pid>/environ by
tests/integration/test_deploy_triton.py. Here, the allowlist's output for a planted environment; a test that restated
the lists' names (issue 44) is gone.
"""

from __future__ import annotations

import pytest

from lmforge.deploy import server

PASSWORD = "s3cr3t-pw"
# Names that look harmless, values that carry a credential: a name-based filter lets every one of them through.
CREDENTIAL_VALUES = {
    "MLFLOW_TRACKING_URI": f"postgresql://lmforge:{PASSWORD}@db.example:5432/mlflow",
    "LMFORGE_TEST_STORE_URL": f"postgresql://user:{PASSWORD}@db.example/x",
    "MY_APP_DSN": f"mysql://app:{PASSWORD}@10.0.0.5/app",
    "DATABASE_URL": f"postgres://u:{PASSWORD}@db/app",
    "REDIS_URL": f"redis://:{PASSWORD}@cache:6379/0",
    "CELERY_BROKER": f"amqp://guest:{PASSWORD}@mq//",
    "MLFLOW_S3_ENDPOINT_URL": f"https://minio:{PASSWORD}@s3.example",
    "PYTHONPATH": "/the/project/src",       # not a credential, but the stub must not import the project's modules
    "PYTHONHOME": "/elsewhere",
    "LD_PRELOAD": "/tmp/evil.so",
    "PREFECT_API_URL": f"https://u:{PASSWORD}@prefect.example/api",
}
# Named like credentials (what the old name-based filter caught): still out.
CREDENTIAL_NAMES = {"AWS_SECRET_ACCESS_KEY": PASSWORD, "HF_TOKEN": PASSWORD, "NVIDIA_API_KEY": PASSWORD,
                    "PGPASSWORD": PASSWORD}
# What tritonserver and the model need: kept as they are.
NEEDED = {
    "PATH": "/usr/local/bin:/usr/bin", "HOME": "/home/lm", "USER": "lm", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
    "LC_CTYPE": "C.UTF-8", "TZ": "UTC", "LD_LIBRARY_PATH": "/opt/lib", "TMPDIR": "/scratch",
    "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "4", "KMP_AFFINITY": "granularity=fine",
    "OMP_PROC_BIND": "close", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": "0",
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "NVIDIA_VISIBLE_DEVICES": "all", "HF_HUB_OFFLINE": "1",
}


def test_the_allowlist_keeps_what_serving_needs_and_drops_every_credential_whatever_its_name():
    env = server.allowed_env({**CREDENTIAL_VALUES, **CREDENTIAL_NAMES, **NEEDED})
    assert env == NEEDED
    assert PASSWORD not in "\n".join(f"{k}={v}" for k, v in env.items())


def test_the_server_env_is_the_allowlist_plus_the_serving_venv(monkeypatch):
    venv = server.serve_venv()
    if not (venv / "bin" / "python").exists():
        pytest.skip("no .venv-serve here (scripts/bootstrap.sh builds it)")
    for name, value in {**CREDENTIAL_VALUES, **CREDENTIAL_NAMES}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = server.server_env()
    assert PASSWORD not in "\n".join(f"{k}={v}" for k, v in env.items())
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["VIRTUAL_ENV"] == str(venv.resolve()) and env["PATH"].split(":")[0] == str(venv.resolve() / "bin")
    assert set(env) - set(server.allowed_env(env)) == {"VIRTUAL_ENV"}  # the one variable lmforge adds
