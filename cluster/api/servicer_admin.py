"""The operator-facing servicer, ``orchard.v1.Admin``: workers, scaling, draining, invalidation.

Every call needs an admin key. The work is the backend's; this module validates, converts and
maps errors (``cluster.api.edge``).
"""
from __future__ import annotations

from typing import Callable

from cluster.api import validate
from cluster.api.chat import ChatTokenizer
from cluster.backend.protocol import Backend, ModelInfo, UnknownWorker
from cluster.api.convert import messages_from_pb, stats_to_pb, worker_to_pb
from cluster.api.edge import Authenticator, grpc_errors
from proto.orchard.v1 import orchard_pb2 as pb
from proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from router.kv.key import Namespace


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, auth: Authenticator, backend: Backend, model: ModelInfo,
                 tokenizer: ChatTokenizer, tenants: list[str],
                 namespace: Callable[[str], Namespace],
                 on_invalidated: Callable[[str], None] | None = None):
        self._auth = auth
        self._backend = backend
        self._model = model
        self._tokenizer = tokenizer  # render_prefix: the template with no generation prompt
        self._tenants = tenants
        self._namespace = namespace
        self._on_invalidated = on_invalidated  # miss attribution learns of the invalidation

    def authenticate(self, context) -> None:
        self._auth.admin(context)

    @grpc_errors
    async def ListWorkers(self, request, context) -> pb.ListWorkersResponse:
        self._auth.admin(context)
        return pb.ListWorkersResponse(
            workers=[worker_to_pb(w) for w in await self._backend.workers()])

    @grpc_errors
    async def Scale(self, request: pb.ScaleRequest, context) -> pb.ListWorkersResponse:
        self._auth.admin(context)
        if request.workers < 1:
            raise validate.FieldError("workers", f"must be >= 1, got {request.workers}")
        workers = await self._backend.scale(request.workers)
        return pb.ListWorkersResponse(workers=[worker_to_pb(w) for w in workers])

    @grpc_errors
    async def Drain(self, request: pb.DrainRequest, context) -> pb.Worker:
        self._auth.admin(context)
        if not request.worker_id:
            raise validate.FieldError("worker_id", "required")
        if len(request.worker_id) > validate.QUOTE_CHARS:  # longer than any worker id
            raise UnknownWorker(f"worker_id: no worker {validate.quoted(request.worker_id)}")
        return worker_to_pb(await self._backend.drain(request.worker_id))

    @grpc_errors
    async def Invalidate(self, request: pb.InvalidateRequest, context) -> pb.InvalidateResponse:
        self._auth.admin(context)
        if request.tenant not in self._tenants:
            raise validate.FieldError("tenant", f"unknown tenant {validate.quoted(request.tenant)}; known: "
                                      f"{', '.join(self._tenants) or 'none'}")
        prefix: tuple[int, ...] | None = None
        kind = request.WhichOneof("prefix")
        if kind == "messages":
            messages = validate.messages_to_dicts(messages_from_pb(request.messages.messages),
                                                  "messages")
            prefix = tuple(await self._tokenizer.off_loop(self._tokenizer.render_prefix,
                                                          messages))
        elif kind == "tokens":
            prefix = validate.check_token_ids(request.tokens.ids, "tokens.ids",
                                              self._model.vocab_size)
        removed = await self._backend.invalidate(self._namespace(request.tenant), prefix)
        if removed and self._on_invalidated is not None:
            self._on_invalidated(request.tenant)
        return pb.InvalidateResponse(blocks_removed=removed)

    @grpc_errors
    async def GetCacheStats(self, request, context) -> pb.CacheStats:
        self._auth.admin(context)
        return stats_to_pb(await self._backend.cache_stats())
