"""The control plane: config, Ray bootstrap and placement, the gRPC servicer, the durable job
store, scaling and draining, telemetry setup, and the ``orchard`` command line."""
