"""The committed generated code matches the .proto, and the API has the services it promises."""
from proto import generate
from proto.orchard.v1 import orchard_pb2


def test_generated_code_is_not_stale():
    assert generate.stale_files() == [], "run `python -m proto.generate` and commit the result"


def test_services_and_methods():
    services = {s.name: [m.name for m in s.methods]
                for s in orchard_pb2.DESCRIPTOR.services_by_name.values()}
    assert services == {
        "Jobs": ["SubmitJob", "SubmitBatchFile", "GetJob", "ListJobs", "StreamResults", "CancelJob"],
        "Generate": ["Generate"],
        "Admin": ["ListWorkers", "Scale", "Drain", "Invalidate", "GetCacheStats"],
    }
    assert orchard_pb2.DESCRIPTOR.package == "orchard.v1"
