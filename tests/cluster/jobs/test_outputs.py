"""Structured outputs and log-probabilities in jobs: ``SubmitJob`` over gRPC and ``orchard
submit`` files take the same ``response_format`` as the HTTP API (a schema that cannot compile
refused at submission, naming the request or line and the schema's path, with nothing
stored), results carry each token's log-probability, and ``orchard results`` writes them in
OpenAI's Batch output shape. Fields a batch line cannot ask for are refused naming the line.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from cluster.api.batchfile import parse_batch
from cluster.api.client import OrchardError, chat_request
from cluster.cli import main
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, running_frontend

PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                        "legs": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["kind", "legs"], "additionalProperties": False}
BROKEN = {"type": "array", "items": {"type": "string", "pattern": "(?<=a)b"}}  # look-behind
BROKEN_PATH = "response_format.json_schema.schema.items"
USER = [{"role": "user", "content": "A pet, please."}]


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema,
                                                   "strict": True}}


def line(custom_id: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": USER, "max_tokens": 40,
                                "temperature": 0, **body}})


def request(custom_id: str, schema: dict, top: int | None = None):
    (pb_request,) = parse_batch([line(custom_id, response_format=fmt(schema),
                                      **({} if top is None else
                                         {"logprobs": True, "top_logprobs": top}))]).requests
    return pb_request


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    with running_frontend(run_dir, tiny_model(), workers=1) as harness:
        yield harness


def cli(frontend, *args):
    return main([*args, "--address", frontend.address, "--api-key", "key-acme"])


def test_a_file_line_carries_the_format_and_logprobs_into_the_request():
    pb_request = request("a", PET, top=3)
    assert pb_request.response_format.type == "json_schema"
    assert pb_request.response_format.json_schema.name == "pet"
    assert (pb_request.logprobs, pb_request.top_logprobs) == (True, 3)


@pytest.mark.parametrize("body, what", [
    ({"presence_penalty": 0.3}, "body.presence_penalty: not implemented; only 0"),
    ({"n": 3}, "body.n: only n = 1"),
    ({"stream": True}, "body.stream: a batch line is answered in the output file"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "body.tools: not supported "
     "in a batch"),
    ({"top_logprobs": 2}, "body.top_logprobs: needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 30}, "body.top_logprobs: must be from 0 to 20"),
    ({"response_format": {"type": "yaml"}}, "body.response_format.type: must be one of"),
    ({"colour": "red"}, "body.colour: not supported by orchard"),
])
def test_what_a_line_cannot_ask_for_names_the_line_and_field(body, what):
    with pytest.raises(ValueError) as err:
        parse_batch([line("ok"), line("bad", **body)], name="b.jsonl")
    assert str(err.value).startswith(f"b.jsonl:2: {what}")


def test_submit_job_with_a_schema_that_cannot_compile_is_refused_and_nothing_stored(frontend):
    with frontend.client("acme") as client:
        before = client.jobs()
        with pytest.raises(OrchardError) as caught:
            client.submit([request("a", PET), request("b", BROKEN)])
        assert client.jobs() == before
    assert caught.value.code == "INVALID_ARGUMENT"
    assert caught.value.message.startswith(f"requests[1].{BROKEN_PATH}: ")
    assert "look-around" in caught.value.message


def test_submit_job_outputs_validate_and_carry_logprobs(frontend):
    with frontend.client("acme") as client:
        job = client.submit([request(f"r{i}", PET, top=2) for i in range(3)]
                            + [chat_request("plain", USER, 3)])
        client.wait(job.job_id)
        results = {r.custom_id: r for r in client.results(job.job_id)}
    for i in range(3):
        result = results[f"r{i}"]
        jsonschema.validate(json.loads(result.text), PET)
        assert len(result.logprobs) == len(result.output_tokens)
        for entry, token in zip(result.logprobs, result.output_tokens):
            assert entry.token_id == token and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    assert list(results["plain"].logprobs) == []


def test_orchard_submit_names_the_line_and_path_of_a_schema_that_cannot_compile(
        frontend, tmp_path, capsys):
    with frontend.client("acme") as client:
        before = client.jobs()
    path = tmp_path / "pets.jsonl"
    path.write_text(line("a", response_format=fmt(PET)) + "\n"
                    + line("b", response_format=fmt(BROKEN)) + "\n")
    assert cli(frontend, "submit", str(path)) == 2
    err = capsys.readouterr().err
    assert f"INVALID_ARGUMENT: pets.jsonl:2: body.{BROKEN_PATH}: " in err
    with frontend.client("acme") as client:
        assert client.jobs() == before


def test_orchard_results_writes_logprobs_and_outputs_that_validate(frontend, tmp_path, capsys):
    path = tmp_path / "pets.jsonl"
    path.write_text("".join(line(f"p{i}", response_format=fmt(PET), logprobs=True,
                                 top_logprobs=1, seed=i, temperature=1.0) + "\n"
                            for i in range(3)))
    assert cli(frontend, "submit", str(path), "--wait", "--json",
               "--run-dir", str(frontend.config.run_dir)) == 0
    job = json.loads(capsys.readouterr().out)
    out = tmp_path / "results.jsonl"
    assert cli(frontend, "results", job["job_id"], "--out", str(out)) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["p0", "p1", "p2"]
    for x in lines:
        body = x["response"]["body"]
        choice = body["choices"][0]
        jsonschema.validate(json.loads(choice["message"]["content"]), PET)
        entries = choice["logprobs"]["content"]
        assert len(entries) == body["usage"]["completion_tokens"]
        assert all(len(e["top_logprobs"]) == 1 and e["bytes"] == list(
            bytes(e["bytes"])) for e in entries)
        joined = b"".join(bytes(e["bytes"]) for e in entries).decode()
        assert joined.strip() == choice["message"]["content"].strip()
