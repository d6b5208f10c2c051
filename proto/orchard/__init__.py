"""The ``orchard`` protobuf package."""
