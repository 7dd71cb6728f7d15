"""The local runtime: the device and precision (accelerator, cpus), starting, watching and stopping processes
(supervisor, service, ports), and the files the package ships (resources)."""
