"""What structured outputs and log-probabilities cost inside the batch: ``orchard bench outputs``.

A job of extraction requests (one shared instruction, a short document each, a JSON schema of
five fields with an enum and an array) runs on one engine three ways, interleaved round by
round so load on a shared machine hits all alike: free text, the same requests with
``response_format`` (strict JSON schema), and free text with ``logprobs`` (top 5). Figures:

- ``json_schema_wall_ratio``: constrained wall time over free (best round of each); the output
  token counts are printed beside it, since a grammar also changes how long outputs are;
- ``json_schema_valid_share``: outputs that parse and validate against the schema (those cut by
  ``max_tokens`` count as invalid);
- ``tpot_ratio``: constrained over free time per output token;
- ``logprobs_wall_ratio``: with log-probabilities over free;
- ``mask_share_of_step``: time in masks and matcher steps over the decode steps' time, in the
  constrained run at the engine's batch size;
- ``compile_ms``: the schema's compile time (once per schema: every request shares it).

With ``vs_mlx_lm`` the same requests also go to ``mlx_lm.server``, each kind right after
orchard's in every round (``workers.lab.outputs_mlx_lm``), under ``mlx_lm``.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field

import jsonschema

from router.kv.key import Namespace
from workers.engine.config import EngineConfig
from workers.engine.constraints import grammar_of
from workers.engine.engine import Engine
from workers.messages import GenerateRequest, GenerateResult, ResponseFormat, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "teacher", "farmer", "artist"]},
        "city": {"type": "string", "maxLength": 24},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16},
                   "maxItems": 3},
    },
    "required": ["name", "age", "role", "city", "skills"],
    "additionalProperties": False,
}
INSTRUCTION = ("Extract the person described in the document as JSON with the fields name, "
               "age, role (engineer, doctor, teacher, farmer or artist), city and skills (a "
               "list of at most three short strings). Answer with the JSON object only.")
_NAMES = "Ada Ben Chloe Dan Eve Farid Gina Hugo Iris Jon Kai Lena Milo Nora Omar Pia".split()
_CITIES = "Paris Lyon Oslo Rome Porto Quito Lima Cairo Delhi Seoul Perth Austin".split()
_ROLES = SCHEMA["properties"]["role"]["enum"]
_SKILLS = "welding chess baking coding singing surgery carpentry teaching".split()


@dataclass(frozen=True, slots=True)
class OutputsBench:
    model: str
    requests: int
    max_tokens: int
    rounds: int
    free_wall_s: float
    json_wall_s: float
    logprobs_wall_s: float
    free_output_tokens: int
    json_output_tokens: int
    json_schema_wall_ratio: float
    json_schema_valid_share: float
    tpot_ratio: float
    logprobs_wall_ratio: float
    mask_share_of_step: float
    compile_ms: float
    mlx_lm: dict | None = field(default=None)  # the same job through mlx_lm.server

    def as_json(self) -> dict:
        return asdict(self)


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        skills = rng.sample(_SKILLS, rng.randint(1, 3))
        out.append(f"Document {i}: {rng.choice(_NAMES)} is a {rng.randint(20, 70)}-year-old "
                   f"{rng.choice(_ROLES)} from {rng.choice(_CITIES)} who is good at "
                   f"{', '.join(skills)}.")
    return out


def run_outputs_bench(model_dir, requests: int = 200, max_tokens: int = 128, rounds: int = 2,
                      max_batch: int = 8, vs_mlx_lm: bool = False) -> OutputsBench:
    engine = Engine.open(model_dir, EngineConfig(max_batch=max_batch))
    ns = Namespace("bench", engine.model_id, engine.revision)
    chats = [[{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": d}]
             for d in documents(requests)]
    prompts = [engine.render_chat(chat) for chat in chats]
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA, sort_keys=True), "person", True)
    start = time.perf_counter()
    grammar_of.cache_clear()
    grammar_of(fmt)
    compile_ms = (time.perf_counter() - start) * 1e3
    runs: dict[str, list] = {"free": [], "json": [], "logprobs": []}
    sampling = {"free": SamplingParams(max_tokens=max_tokens),
                "json": SamplingParams(max_tokens=max_tokens, response_format=fmt),
                "logprobs": SamplingParams(max_tokens=max_tokens, logprobs=5)}
    _run(engine, ns, prompts[:8], sampling["json"], "warm")  # the tokenizer's grammar side
    mlx = None
    if vs_mlx_lm:
        from workers.lab.outputs_mlx_lm import MlxLmSide
        mlx = MlxLmSide(str(model_dir), max_tokens, SCHEMA)
    try:
        for r in range(rounds):
            for kind in runs:
                runs[kind].append(_run(engine, ns, prompts, sampling[kind], f"{kind}{r}"))
                if mlx is not None:
                    mlx.run(kind, chats)
        mlx_figures = asdict(mlx.figures()) if mlx is not None else None
    finally:
        if mlx is not None:
            mlx.close()
    best = {k: min(v, key=lambda run: run.wall_s) for k, v in runs.items()}
    free, constrained = best["free"], best["json"]
    valid = sum(_valid(r) for r in constrained.results)
    free_tpot = free.wall_s / max(1, free.tokens)
    json_tpot = constrained.wall_s / max(1, constrained.tokens)
    return OutputsBench(
        str(model_dir), requests, max_tokens, rounds, round(free.wall_s, 3),
        round(constrained.wall_s, 3), round(best["logprobs"].wall_s, 3), free.tokens,
        constrained.tokens, round(constrained.wall_s / free.wall_s, 4),
        round(valid / requests, 4), round(json_tpot / free_tpot, 4),
        round(best["logprobs"].wall_s / free.wall_s, 4),
        round(constrained.grammar_s / max(1e-9, constrained.decode_s), 4), round(compile_ms, 3),
        mlx_figures)


@dataclass(slots=True)
class _Run:
    wall_s: float
    decode_s: float      # steps that decoded, timed whole
    grammar_s: float     # of which, masks and matcher steps
    tokens: int
    results: list[GenerateResult]


def _run(engine: Engine, ns: Namespace, prompts, sampling: SamplingParams, tag: str) -> _Run:
    engine.invalidate(ns)  # each run starts from the same empty cache but the instruction's
    grammar_before = engine.constraint_seconds()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.submit(GenerateRequest(f"{tag}-{i}", ns, tuple(prompt), sampling, batch=True))
    results, decode_s = [], 0.0
    while engine.busy:
        step_start = time.perf_counter()
        out = engine.step()
        if out.deltas:
            decode_s += time.perf_counter() - step_start
        results.extend(out.finished)
    wall = time.perf_counter() - start
    tokens = sum(len(r.output_tokens) for r in results)
    return _Run(wall, decode_s, engine.constraint_seconds() - grammar_before, tokens, results)


def _valid(result: GenerateResult) -> bool:
    return result.finish_reason == "stop" and valid_json(result.text, SCHEMA)


def valid_json(text: str, schema: dict) -> bool:
    """Whether ``text`` parses as JSON and validates against ``schema``."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
