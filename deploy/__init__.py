"""Serving on Triton Inference Server: the model repository, the server, the client and the gated rollout.

    from lmforge.deploy import deployment
    info = deployment.ensure_server(ws, cfg.deploy)             # tritonserver on loopback (deploy/server.py)
    deployment.deploy_version(ws, cfg.deploy, info, registry_model="lmforge-lm", version=3, model_dir=folder)

Modules: processing.py (pre/post-processing, no server needed), model.py (the python-backend
TritonPythonModel, copied into the repository), repository.py (config.pbtxt and version folders),
server.py (start/stop, state file), client.py (tritonclient HTTP/gRPC), rollout.py (the gate),
deployment.py (registry + server + gate, what flows/deploy.py and the CLI call).
"""
