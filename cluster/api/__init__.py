"""The tenant- and operator-facing edge: the gRPC server and servicers, auth and error
mapping, validation, batch files, tokenization at the frontend, and the Python client."""
