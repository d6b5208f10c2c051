"""``orchard traces gather``: each node's trace files copied through Ray into one directory
that ``orchard report`` reads. One embedded Ray node here; the files are real OTLP/JSON lines
written by the file exporter."""
import pytest

ray = pytest.importorskip("ray")

from cluster.backend import bootstrap  # noqa: E402
from cluster.cli import main  # noqa: E402
from cluster.report.build import build_report  # noqa: E402
from cluster.telemetry import spans  # noqa: E402
from cluster.telemetry.metrics import RequestUsage  # noqa: E402
from cluster.telemetry.otlp_json import read_spans  # noqa: E402
from cluster.telemetry.setup import TelemetrySettings, setup_telemetry  # noqa: E402

pytestmark = pytest.mark.slow


def write_traces(run_dir, service, request_id):
    tel = setup_telemetry(TelemetrySettings(service, run_dir))
    tel.instruments.record_request(RequestUsage("w0", "acme", "hit", "chat", "tiny", 10, 8, 0,
                                                3, 0.01, 0.001))
    with spans.request_span(tel, spans.RequestInfo(request_id, "acme", "tiny", job_id="j1")):
        pass
    tel.shutdown()


def test_gather_copies_every_nodes_files_and_the_report_reads_them(tmp_path, capsys):
    run_dir, out = tmp_path / "run", tmp_path / "gathered"
    write_traces(run_dir, "orchard-frontend", "r1")
    write_traces(run_dir, "orchard-worker", "r2")
    names = sorted(p.name for p in (run_dir / "traces").glob("*.jsonl"))
    address = bootstrap.start_local(num_cpus=1)
    try:
        assert main(["traces", "gather", "--run-dir", str(run_dir), "--ray-address", address,
                     "--out", str(out)]) == 0
    finally:
        bootstrap.shutdown()
    captured = capsys.readouterr()
    assert "gathering from 1 node(s)" in captured.err and "wrote 4 files" in captured.out
    assert sorted(p.name for p in (out / "traces").glob("*.jsonl")) == names
    assert len(list((out / "metrics").glob("*.jsonl"))) == 2
    for name in names:
        assert (out / "traces" / name).read_bytes() == (run_dir / "traces" / name).read_bytes()
    report = build_report(read_spans(out / "traces").spans)
    assert report["requests"] == 0   # request spans without usage: counted only when finished
    assert {s.attributes["orchard.request.id"] for s in read_spans(out / "traces").spans} == {
        "r1", "r2"}


def test_gather_refuses_to_write_into_the_run_dir(tmp_path):
    from cluster.telemetry.gather import gather
    with pytest.raises(ValueError, match="--out must differ"):
        gather(tmp_path, tmp_path, [])
