"""Every span and metric attribute name orchard writes, defined once.

Standard OpenTelemetry GenAI names (``gen_ai.*``) where one exists; orchard's own under
``orchard.*``. ``orchard report`` reads traces by these names, so a rename here is a format
change: keep old names readable in the report when changing one.
"""

# --- OpenTelemetry GenAI semantic conventions ---------------------------------------------
GEN_AI_OPERATION = "gen_ai.operation.name"          # "chat" or "text_completion"
GEN_AI_SYSTEM = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_CONVERSATION = "gen_ai.conversation.id"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"   # includes cached tokens
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_CACHE_WRITE = "gen_ai.usage.cache_write.input_tokens"
GEN_AI_CACHE_CREATION = "gen_ai.usage.cache_creation.input_tokens"  # older name, same value
GEN_AI_TTFT_METRIC = "gen_ai.server.time_to_first_token"
GEN_AI_TPOT_METRIC = "gen_ai.server.time_per_output_token"
GEN_AI_TOKEN_USAGE_METRIC = "gen_ai.client.token.usage"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"             # "input" or "output"
OPERATION_CHAT = "chat"                             # the prompt came as messages
OPERATION_TEXT = "text_completion"                  # the prompt came as token ids
ERROR_TYPE = "error.type"                           # a failed request's gRPC status name
CLIENT_DISCONNECTED = "orchard.request.client_disconnected"  # true: the caller left first
PROVIDER = "orchard"

# --- orchard -------------------------------------------------------------------------------
SPAN_KIND = "orchard.span"   # request | route | worker | lookup | prefill | decode | job
REQUEST_ID = "orchard.request.id"
JOB_ID = "orchard.job.id"
TENANT = "orchard.tenant"
TURN = "orchard.conversation.turn"
WORKER = "orchard.worker.id"
NODE_ADDRESS = "orchard.node.address"   # resource: the Ray node a process runs on
NODE_ID = "orchard.node.id"
HOST_NAME = "host.name"                 # resource (semantic conventions)
ATTEMPTS = "orchard.attempts"
TTFT_S = "orchard.latency.ttft_s"
TPOT_S = "orchard.latency.tpot_s"
COMPUTED_TOKENS = "orchard.usage.computed_tokens"
PROMPT_BLOCKS = "orchard.prompt.block_hashes"  # 64-bit hex prefixes, for drift detection
BLOCK_SIZE = "orchard.block_size"

ROUTE_WORKER = "orchard.route.worker"
ROUTE_REASON = "orchard.route.reason"
ROUTE_EXPECTED_CACHED = "orchard.route.expected_cached_tokens"
ROUTE_CANDIDATES = "orchard.route.candidates"
ROUTE_PULL_FROM = "orchard.route.pull_from"            # the peer a pull was planned from
ROUTE_PULL_TOKENS = "orchard.route.pull_tokens"        # tokens it was to bring
ROUTE_PULL_PREDICTED_S = "orchard.route.pull_predicted_s"  # the router's predicted pull time
ROUTE_CANDIDATE_EVENT = "orchard.route.candidate"
CANDIDATE_WORKER = "orchard.candidate.worker"
CANDIDATE_MATCHED = "orchard.candidate.matched_tokens"
CANDIDATE_LOAD = "orchard.candidate.load"
CANDIDATE_SCORE = "orchard.candidate.score"

CACHE_OUTCOME = "orchard.cache.outcome"             # hit | partial | near_miss | miss
CACHE_PROMPT_TOKENS = "orchard.cache.prompt_tokens"
CACHE_MATCHED = "orchard.cache.matched_tokens"
CACHE_KEPT_TOKENS = "orchard.cache.kept_tokens"     # past matched_tokens, from a kept cache
CACHE_IDENTITY_MISMATCH = "orchard.cache.identity_mismatch"  # blocks refused: another block
CACHE_DISK_TOKENS = "orchard.cache.disk_tokens"     # of matched_tokens, read from the disk tier
CACHE_PULLED_TOKENS = "orchard.cache.pulled_tokens"  # of matched_tokens, pulled from a peer
PULL_REFUSED = "orchard.pull.refused"                # why a planned pull ended early
CACHE_MEMORY_TOKENS = "orchard.cache.memory_tokens"  # of matched_tokens, read from memory
CACHE_TIER = "orchard.cache.tier"                   # none | memory | disk | memory+disk
CACHE_COMMON_PREFIX = "orchard.cache.common_prefix"
CACHE_NEXT_PROMPT_TOKEN = "orchard.cache.next_prompt_token"
CACHE_NEXT_STORED_TOKEN = "orchard.cache.next_stored_token"
CACHE_ENTRY_AGE_S = "orchard.cache.entry_age_s"
CACHE_TTL_S = "orchard.cache.ttl_s"
# A request's cache controls (cluster.api.cache_fields) on its span: the TTL its writes keep,
# what it bypassed ("read", "write", both or none), whether it was salted (never the salt).
CACHE_WRITE_TTL_S = "orchard.cache.write_ttl_s"
CACHE_BYPASS = "orchard.cache.bypass"
CACHE_SALTED = "orchard.cache.salted"
CACHE_LINE = "orchard.cache.line"                   # "common=5919 of 5923"
DIVERGENCE_BEFORE = "orchard.cache.divergence.before"  # decoded text before the divergence
DIVERGENCE_PROMPT = "orchard.cache.divergence.prompt_next"
DIVERGENCE_STORED = "orchard.cache.divergence.stored_next"

PREFILL_TOKENS = "orchard.prefill.tokens"
DECODE_TOKENS = "orchard.decode.tokens"
SPEC_DRAFTED = "orchard.spec.drafted_tokens"     # speculative decoding: tokens drafted
SPEC_ACCEPTED = "orchard.spec.accepted_tokens"   # ... of which accepted into the output

COST_PRICE_VERSION = "orchard.cost.price_version"
COST_FORECAST_M = "orchard.cost.forecast_multiplier"
COST_MEASURED_M = "orchard.cost.measured_multiplier"
COST_FORECAST_ERROR = "orchard.cost.forecast_error"
COST_FORECAST_CACHED = "orchard.cost.forecast_cached_tokens"
COST_FORECAST_WRITTEN = "orchard.cost.forecast_written_tokens"
JOB_REQUESTS = "orchard.job.requests"
JOB_FORECAST_INPUT = "orchard.job.forecast_input_tokens"

MISS_CAUSE = "orchard.miss.cause"
MISS_TOKENS = "orchard.miss.tokens"
MISS_HOLDER = "orchard.miss.holder"                 # for routed_elsewhere: who held it
MISS_SERVED = "orchard.miss.served_tier"            # the tier(s) its cached part came from
