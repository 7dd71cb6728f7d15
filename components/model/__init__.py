"""Models: an architecture's capabilities (basemodel, projections, adapters). Loading a model folder and running an
ONNX export are the serving package's (components/serving: modelload, onnxrun). Where a base comes from
(components/registry/basesource.py) and the ONNX export (deploy/onnx_export.py) read the registry, whose imports
reach this package (registry -> data -> model), so they live with the registry and with deploy, not here."""
