"""``orchard.v1``: generated messages (``orchard_pb2``) and service stubs (``orchard_pb2_grpc``)."""
