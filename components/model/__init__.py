"""Models: an architecture's capabilities (basemodel, projections, adapters), loading a model folder as what it is
(modelload), and running an ONNX export (onnxrun). Where a base comes from (components/basesource.py) and the ONNX
export itself (components/onnx_export.py) stay beside: they read the registry, which loads through modelload."""
