"""orchard's public gRPC API: ``orchard/v1/orchard.proto`` and the Python generated from it.

``python -m proto.generate`` regenerates ``orchard/v1/orchard_pb2*.py``; ``--check`` exits
non-zero when the committed files differ from what the .proto produces (a test runs it).
"""
