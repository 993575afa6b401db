"""Every message between the supervisor and its engine processes (msgspec, msgpack on the wire).

    supervisor ──PUSH──► engine i   (one socket per engine incarnation)   ToEngine
    engine *   ──PUSH──► supervisor (one socket shared by all engines)    FromEngine

Token ids cross the boundary, never text: the supervisor tokenizes and detokenizes. Messages are
tagged Structs, so each side decodes a union and dispatches on the type; no pickle, no method
names in strings. Times are `time.monotonic()` seconds, comparable across processes on one host.
"""
from __future__ import annotations

import msgspec


class Sampling(msgspec.Struct, frozen=True):
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int = -1  # -1: none; k >= 0: each sampled token's logprob and the k most likely (at most 20)
    grammar: str | None = None  # structured output: llguidance's grammar (JSON) the output follows


# -- supervisor → engine ---------------------------------------------------------------------
class Coalesce(msgspec.Struct, frozen=True):
    """Rate-aware coalescing of a streamed request's deltas (engine/process/pacing.py): while the client's
    modelled buffer holds at least `buffer` s of reading, its tokens are held and go out together
    `interval` s after the first of them."""

    buffer: float
    interval: float


class PrefixRun(msgspec.Struct, frozen=True):
    """Leading pages of a prompt that an engine of the pool holds (`--pool-mode query|read`): the
    chained keys of consecutive pages, in prompt order."""

    engine: int
    keys: list[bytes]


class KVTarget(msgspec.Struct, frozen=True):
    """Where a prefill node writes a request's prompt KV (federation/): the decode node's transfer
    engine, its cache's layout (transport.py KVLayout) and the pages it allocated for the request."""

    endpoint: str
    bases: list[int]
    shape: list[int]
    itemsize: int
    page_axis: int
    pages: list[int]


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    reading_rate: float  # tokens/s the client reads
    priority: int = 0  # higher is sooner
    arrival_time: float = 0.0
    front: int = 0  # the output (EngineSpec) its deltas go to: the API server process that serves it
    front_epoch: int = 0  # which start of that front sent it (AbortFront)
    coalesce: Coalesce | None = None  # None: every step's tokens at once
    # The pool: runs covering the prompt's leading pages, held by engines of this node (the
    # receiving one too); the engine attends to them where they are instead of computing them.
    prefix: list[PrefixRun] = []
    # The pool: runs of whole segments of the prompt that this engine computes and whose homes are
    # other engines: once computed, their KV is put at the home and not kept here (pool/member.py).
    place: list[PrefixRun] = []
    # The pool: runs of `prefix` held by peers that are heavy hitters: this engine copies them into its
    # own cache first (a replica), and this request and later ones read them here (pool/member.py).
    copy: list[PrefixRun] = []
    # The pool: the first page of the prompt past `prefix` is one an earlier request is computing
    # (router.py PENDING_SECONDS): this one asks where its prefix is as it nears the front, even where
    # the engine would take it at once (pool/ahead.py `waits`)
    pending: bool = False
    # Federation, on a prefill node: compute the prompt, write its KV there layer by layer as each
    # layer ends, sample the first token, and answer Prefilled.
    kv_target: KVTarget | None = None
    kv_deadline: float = 0.0  # ... and start no write after this time (monotonic; 0: none)
    # Federation, on a decode node: a prefill node computes the prompt; allocate its pages and
    # answer Reserved; it decodes once RemoteArrived says the KV is in place.
    remote_kv: bool = False
    # n > 1: the request id of another choice of this prompt; this one starts once that one has its
    # first token, so the prompt's whole pages are computed once and shared (engine/core.py)
    after: str = ""


class RemoteArrived(msgspec.Struct, tag=True):
    """The prefill node answered for a request the decode node reserved pages for: its KV was
    written (`first_token` is what it sampled, `checksum` the pages' crc32) or not (None; `settled`:
    the prefill node answered, its writes are over; the last bytes of a write it saw end may still
    be on the wire, so the pages are freed a grace later)."""

    request_id: str
    first_token: int | None
    checksum: int = 0
    settled: bool = True
    num_cached_tokens: int = 0  # of the prompt, the prefill node's prefix cache held


class KeepKV(msgspec.Struct, tag=True):
    """Federation (store.py): take the whole pages of `token_ids` into the prefix cache from another
    node; answered by Reserved (`held`: leading pages held already; `target`: pages for the next)."""

    store_id: str
    token_ids: list[int]
    front: int = 0


class KeptKV(msgspec.Struct, tag=True):
    """The giver's writes for a KeepKV are settled: publish the pages if their crc32 matches."""

    store_id: str
    ok: bool
    checksum: int = 0
    num_pages: int = 0  # the leading pages of the target written (the giver's cache may hold fewer)
    unwritten: bool = False  # not ok, and the giver never wrote: the pages are free at once


class GiveKV(msgspec.Struct, tag=True):
    """Federation (store.py): write the cached pages of `token_ids` after the first `held` into the
    target; answered by Prefilled (ok, checksum) once the writes have settled."""

    store_id: str
    token_ids: list[int]
    held: int
    target: KVTarget
    front: int = 0
    deadline: float = 0.0  # monotonic: no write starts after it (the keeper frees the pages at its horizon)


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class SetReadingRate(msgspec.Struct, tag=True):
    """The front measured the client's rate (read cursor, send-side backpressure): use it from `time`."""

    request_id: str
    reading_rate: float
    time: float


class SetReadCursor(msgspec.Struct, tag=True):
    """The client's reader has read `num_read` of the tokens delivered to it, by `time` (its
    `POST /v1/requests/{id}/read`): the engine's buffer model is generated − read from there."""

    request_id: str
    num_read: int
    time: float


class QueryRequests(msgspec.Struct, tag=True):
    query_id: int
    request_ids: list[str] | None = None  # None: every live request
    front: int = 0  # the output the reply goes to


class AbortFront(msgspec.Struct, tag=True):
    """An API server process is gone: every request it sent is aborted (its pages freed), and an AddRequest
    it sent that comes later (from another socket, so in no set order with this) is dropped: any with
    a front_epoch up to `epoch`."""

    front: int
    epoch: int = 0


class Shutdown(msgspec.Struct, tag=True):
    pass


class Reconfigure(msgspec.Struct, tag=True):
    """What may change while the engine runs (SIGHUP on the supervisor): answered by Reconfigured."""

    log_level: str
    policy_params: dict  # PolicyConfig fields


class QueryKeys(msgspec.Struct, tag=True):
    """An API server process that starts (or restarts) asks for every page key the prefix cache holds: the
    step messages it missed carried them. Answered by KeySnapshot on that front's output."""

    front: int


class PoolPeer(msgspec.Struct, frozen=True):
    engine: int
    incarnation: int
    pid: int
    num_pages: int  # its KV cache's pages (read mode maps the cache)


class PoolPeers(msgspec.Struct, tag=True):
    """The pool's engines that serve now (the supervisor sends it whenever one comes or goes): a
    peer missing or with a new incarnation is gone, with its segments and its pins."""

    peers: list[PoolPeer]


class ChainEnds(msgspec.Struct, tag=True):
    """The pool's word on where the node's chains end (daemon/prefix_index.py): `inner` keys are
    followed by a page some engine holds, so this engine evicts them last; `ends` are a chain's end
    again, or follow a page gone from the node, so it evicts them first (kv/pages.py set_inner)."""

    inner: list[bytes]
    ends: list[bytes]


class Computing(msgspec.Struct, tag=True):
    """The pool: the step about to run begins computing these requests' prompts (sent before it
    runs: a request the router named to compute a prefix is computing it now, and one told it is
    being computed waits for it: daemon/router.py `being_computed`)."""

    engine_id: int
    incarnation: int
    request_ids: list[str]


class Reads(msgspec.Struct, tag=True):
    """The front's answer to ResolveReads: where the pool holds the queued request's prefix now
    (runs as AddRequest.prefix; []: nowhere but, at most, the engine's own cache), and the hot
    segments among them the engine copies in first (as AddRequest.copy). `pending`: the request
    that AddRequest.pending named as computing the rest of it has not finished its prompt yet: ask
    again a little later (pool/ahead.py ASK_EVERY) rather than compute it too."""

    request_id: str
    prefix: list[PrefixRun] = []
    copy: list[PrefixRun] = []
    pending: bool = False


class Withdraw(msgspec.Struct, tag=True):
    """The pool: a peer is idle and this engine's queue is long (pool/steal.py). The engine gives
    back the last request of `front` queued here that has started nothing and is not in `keep`,
    for the front to send to the idle engine; it answers Withdrawn. `keep`: the requests that stay
    (most of their prompt is held here and not on the idle engine: pool/steal.py `stays`)."""

    front: int = 0
    keep: list[str] = []


class Moved(msgspec.Struct, tag=True):
    """The pool: engine `holder` wrote segments into their homes (`runs`: each home and its keys;
    StepOutputs.keys_moved), and this engine's requests read some of its pages of them: they read
    them at the homes from now on, and the holder's copy goes (PoolMember.follow). The supervisor
    sends it to the engines the holder named (StepOutputs.moved_readers)."""

    holder: int
    runs: list[PrefixRun]


ToEngine = (AddRequest | AbortRequests | SetReadingRate | SetReadCursor | QueryRequests | Shutdown | Reconfigure
            | AbortFront | QueryKeys | PoolPeers | RemoteArrived | KeepKV | KeptKV | GiveKV | ChainEnds | Reads
            | Withdraw | Moved)


# -- engine → supervisor ---------------------------------------------------------------------
class EngineStats(msgspec.Struct):
    num_running: int
    num_waiting: int
    kv_pages_used: int  # referenced by live requests
    kv_pages_cached: int  # unreferenced, kept for prefix hits
    kv_pages_total: int
    num_preemptions: int  # since the engine started
    num_steps: int
    last_step_time: float
    host_kv_pages_used: int = 0  # the host tier (offload/): referenced by requests or copies
    host_kv_pages_cached: int = 0
    host_kv_pages_total: int = 0  # 0: no host tier
    kv_pages_written: int = 0  # device -> host, since the engine started
    kv_pages_loaded: int = 0  # host -> device
    num_shed: int = 0  # requests refused by --max-queue-delay (engine/admission.py), since the engine started
    # prompt tokens of the requests it took, and of them those its own prefix cache held (first
    # admissions) and those it read where peers of the pool hold them; since the engine started
    prompt_tokens: int = 0
    hit_tokens: int = 0
    peer_tokens: int = 0
    pool_queries: int = 0  # layer queries shipped to peers (query mode; read mode: rows not read in place)
    pool_reads: int = 0  # read mode: layers attended over a peer's pages in place (its cache mapped here)
    pool_query_bytes: int = 0  # their query rows and answers
    pool_query_seconds: float = 0.0  # waiting for the answers, after the own attention
    pool_pins: int = 0  # pages pinned here for peers' requests now
    pool_put_pages: int = 0  # pages of new segments written into their homes on peers (placement)
    pool_stored_pages: int = 0  # pages peers put here, this engine being their segments' home
    pool_copied_pages: int = 0  # pages of heavy hitters copied here from peers (replicas)
    pool_unblocked: int = 0  # waiting requests that gave their pins back: nothing could run (engine_hooks.py)
    pool_pinned_queued: int = 0  # requests whose reads waited, pinned once near the queue's front (pool/ahead.py)
    pool_resolved: int = 0  # ... of them, those that pinned reads their front named again then (ResolveReads)
    pool_followed: int = 0  # pages its requests read on a peer that moved to their homes, read there since (Moved)
    kv_remote_pages: int = 0  # federation: pages held for KV other nodes write or may still write
    # the step-time model (a conductor predicts TTFT and TBT from it): s per step and per token
    step_base: float = 0.0
    step_per_token: float = 0.0
    waiting_tokens: int = 0  # prompt tokens queued here and not yet computed
    pool_share: float = 0.0  # of the engine's time, the share serving its peers took lately (its step model's)
    # how it reads peers' pages: "shared memory" (read mode, CPU), "cuda ipc" (read mode, GPU),
    # "cuda ipc (query mode)" (its query rows on the GPU, opened by the holder), "host staging (query
    # mode)" (CPU) or "host staging (--no-pool-ipc)"; "": no pool. And the peers it stages through
    # the host instead, with why (a GPU without peer access, IPC refused)
    pool_path: str = ""
    pool_staged: dict[int, str] = {}
    pool_peer_access: dict[str, bool] = {}  # a GPU engine's start-up check: other GPUs it sees -> peer access
    kv_links: dict[str, float] = {}  # federation: peer transfer engine -> bytes/s its writes there achieved
    kv_egress: float = 0.0  # ... and bytes/s of its writes to all peers together (transport.egress_bandwidth)


class Ready(msgspec.Struct, tag=True):
    engine_id: int
    incarnation: int
    pid: int
    model: str
    max_model_len: int
    page_size: int
    device: str
    stats: EngineStats
    policy: str = ""
    policy_params: dict = {}  # the PolicyConfig fields it schedules with
    fallback: str = ""  # the fast paths start-up stepped down from, and why (engine/startup.py); "": none
    pool_segment_pages: int = 0  # the pool's segment size (pool/segments.py); 0: pool off
    pool_query_row_bytes: int = 0  # a query row shipped to a holder and answered, all layers (dispatch's costs)
    pool_kv_token_bytes: int = 0  # a token's KV, all layers (a put's cost)
    kv_token_bytes: int = 0  # a token's KV, all layers, as it travels between nodes (a conductor prices fetches)
    kv_endpoint: str = ""  # its KV transfer engine (prefill and decode roles): peers' links name it
    attention: str = ""  # the attention path it runs (engine/startup.py FastPaths.describe)
    cuda_graphs: bool = False  # decodes replay CUDA graphs
    overlap: bool = False  # overlap scheduling: the next step launched while one runs (engine/core.py)
    attention_note: str = ""  # why a GPU engine left to choose runs the torch backend
    # a GPU engine's CUDA MPS: the control daemon's pipe directory it is a client of; "": none runs
    # (its kernels time-slice with the other engines on its GPU), or a CPU engine
    mps: str = ""


class TokenLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """A sampled token's log-probability under the model (the raw logits' log-softmax, before
    penalties and temperature), and the k most likely tokens' ids and log-probabilities."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class Delta(msgspec.Struct):
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error | rejected | shed (--max-queue-delay)
    error: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0  # of the request so far
    retry_after: float | None = None  # shed: s after which a retry can expect to be admitted
    logprobs: list[TokenLogprobs] | None = None  # one a token of token_ids, where the request asks


class StepOutputs(msgspec.Struct, tag=True):
    engine_id: int
    incarnation: int
    time: float
    deltas: list[Delta]
    stats: EngineStats
    keys_added: list[bytes] = []  # prefix-cache page keys published since the last message
    keys_removed: list[bytes] = []  # ... and evicted
    # pool: segments this engine wrote into their homes since the last message, now held there (its
    # own keys of them are in keys_removed: the front learns of both at once, before the home reports)
    keys_moved: list[PrefixRun] = []
    # ... and the peers whose requests read this engine's pages of them: the supervisor tells them
    # where they went (Moved)
    moved_readers: list[int] = []


class RequestInfo(msgspec.Struct):
    request_id: str
    state: str  # waiting | running | loading (KV coming back from the host tier) | preempted
    reading_rate: float
    priority: int
    arrival_time: float
    first_token_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    buffer_tokens: float  # the client's modelled buffer now
    stall_time: float
    num_stalls: int
    num_pages: int
    front: int = 0  # the API server process that serves it (--api-servers N > 1), as the engine knows it


class QueryReply(msgspec.Struct, tag=True):
    engine_id: int
    incarnation: int
    query_id: int
    requests: list[RequestInfo]


class Reconfigured(msgspec.Struct, tag=True):
    engine_id: int
    incarnation: int
    log_level: str
    policy_params: dict  # what it schedules with from now on


class KeySnapshot(msgspec.Struct, tag=True):
    """Every page key the engine's prefix cache holds now; later StepOutputs on the same output carry
    what changes after it."""

    engine_id: int
    incarnation: int
    keys: list[bytes]


class Reserved(msgspec.Struct, tag=True):
    """A decode node's answer to AddRequest(remote_kv): where the prefill node is to write (None:
    no room now; the request was then queued to compute its prompt here) or why it was refused."""

    engine_id: int
    incarnation: int
    request_id: str
    target: KVTarget | None = None
    error: str | None = None
    held: int = 0  # KeepKV: leading pages held already


class Prefilled(msgspec.Struct, tag=True):
    """A prefill node's answer to AddRequest(kv_target), once its writes are settled: the KV is
    at the target (ok, with the first token and the pages' crc32) or not."""

    engine_id: int
    incarnation: int
    request_id: str
    ok: bool
    first_token: int | None = None
    checksum: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    num_pages: int = 0  # GiveKV: pages written
    unwritten: bool = False  # GiveKV: refused before any write (nothing can land at the target)


class ResolveReads(msgspec.Struct, tag=True):
    """The pool: a queued request nears the front of its engine's queue (pool/ahead.py) and asks the
    front that placed it where the pool holds its prompt's prefix now, not where it did when the
    request came (a document a request before it was still computing). The front answers Reads."""

    engine_id: int
    incarnation: int
    request_id: str


class Withdrawn(msgspec.Struct, tag=True):
    """The answer to Withdraw: the requests the engine gave back ([]: none could go). Each is gone
    from the engine, its pages and pins let go of; it has sent nothing of it."""

    engine_id: int
    incarnation: int
    request_ids: list[str]


FromEngine = (Ready | StepOutputs | QueryReply | Reconfigured | KeySnapshot | Reserved | Prefilled | ResolveReads
              | Withdrawn | Computing)


class EngineSpec(msgspec.Struct):
    """How the supervisor starts an engine process (passed as JSON on its command line)."""

    engine_id: int
    incarnation: int
    input_address: str  # the engine binds it; the supervisor and every front connect
    output_address: str  # output 0: the supervisor (and, with one API server process, the front)
    heartbeat_interval: float
    config: dict  # EngineConfig fields
    # s one message may wait for the supervisor to take it; beyond, the engine exits (the supervisor
    # kills an engine silent for its heartbeat timeout anyway, so waiting longer serves no one)
    send_timeout: float = 30.0
    supervisor_pid: int = 0  # the parent it must not outlive (0: whatever parent it starts with)
    # outputs 1..N: the API server processes of --api-servers N > 1 (a request's deltas go to its front;
    # what every front needs, Ready and the step messages' stats and keys, goes to all)
    front_addresses: list[str] = []
    runtime_dir: str = ""  # the daemon's private directory (the pool's sockets and shared caches)


# -- the supervisor and its API server processes (--api-servers N > 1) ---------------------------------
class EngineState(msgspec.Struct):
    """One engine as the supervisor knows it: what an API server process needs to talk to it and report it."""

    engine_id: int
    incarnation: int
    state: str  # starting | ready | backoff | stopped
    pid: int | None
    num_restarts: int
    consecutive_failures: int
    last_failure: str | None
    preemptions_before: int
    policy_params: dict
    info: Ready | None


class EngineTable(msgspec.Struct, tag=True):
    """Supervisor → every API server process (zmq PUB), on every change and every heartbeat interval."""

    engines: list[EngineState]
    log_level: str


class FrontListening(msgspec.Struct, tag=True):
    """An API server process → the supervisor: its port is open."""

    front: int
    pid: int


class ApiServerSpec(msgspec.Struct):
    """How the supervisor starts an API server process (JSON on its stdin: the [auth] keys are secrets)."""

    front: int  # 1..N: its output index at every engine
    runtime_dir: str
    input_address: str  # where it binds for the engines' outputs
    control_address: str  # the supervisor's EngineTable publisher
    report_address: str  # where it sends FrontListening
    server: dict  # ServerConfig fields
    engine: dict  # EngineConfig fields
    engines: list[dict]  # each engine's EngineConfig fields, as the supervisor placed them (no GPU probe again)
    fronts: int = 1  # N of --api-servers N
    epoch: int = 0  # how many times this front was started before (AddRequest.front_epoch)
