"""The route key of a generation request: the prefix-cache key of its first few blocks.

A replica serves a prompt's leading blocks from its cache only if it computed them before,
so requests that start alike should meet on one replica. The ingress reads the body as the
replica will (the same pydantic request, the same chat template through the same
Tokenizer.encode_chat), and keys the first `route_blocks` full blocks exactly as
kvlm.cache.prefix keys them:

    ids:   [ block 0 ][ block 1 ][ block 2 ][ block 3 ][ block 4 ] ... [ tail ]
    key:   k3 = H(H(H(H(root(salt), b0), b1), b2), b3)             route_blocks = 4

Four blocks (64 tokens) cover a chat template's head and the start of a system prompt:
enough to tell tenants apart, few enough that two questions under one system prompt share
the key. A prompt of fewer full blocks is keyed by those it has; one with none has no key
(it shares nothing worth routing for). A body the ingress cannot read has no key either:
the replica it lands on answers its 400.

Ollama's /api/chat and /api/generate are keyed by the chat (or, raw, the completion) they
mean (kvlm.server.ollama), as the replica runs it, so an Ollama client's conversation meets
its prefix too.

A Responses request that names a stored response (`previous_response_id`, an
`item_reference`, or GET/DELETE/cancel of /v1/responses/{id}) must reach the replica that
stored it: each replica writes its tag (`replica_tag`, 8 hex digits of its Ray Serve
replica id) into the ids it makes, `resp_<tag>_<hex>` (kvlm.server.responses_api), and
`affinity` reads the tag back for the router, which then sends the request there (that
replica's prefix cache holds the conversation too). A tag no live replica has (it died
and came back under a new id) routes as usual, and the replica answers "not found".

llama-server's slots (kvlm.server.slots) are each one replica's: slot N lives on replica
N mod R (the R live replicas in the order of their ids), so `slot_of` reads the slot a
request names (POST /slots/N, or a completion's `id_slot` N) and the router sends it
there: the conversation run under a slot, its save, its restore and the next turn under
it all meet on one replica (the ingress's GET /slots lists each slot as its replica has
it). A request naming no slot routes by its prefix, as any other.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys

from kvlm.cache.prefix import block_key, root_key
from kvlm.errors import KvlmError
from kvlm.loading.tokenizer import Tokenizer
from kvlm.server import anthropic, ollama, responses_api
from kvlm.server.anthropic import MessagesRequest
from kvlm.server.protocol import ChatCompletionRequest, CompletionRequest
from kvlm.server.responses_api import ResponsesRequest

ROUTE_BLOCKS = 4
_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
           "/v1/messages": MessagesRequest, "/v1/responses": ResponsesRequest,
           "/api/chat": ollama.ChatRequest, "/api/generate": ollama.GenerateRequest}  # fmt: skip
_RESPONSES = "/v1/responses"
_SLOTS = "/slots/"
_SLOTTED = ("/v1/completions", "/v1/chat/completions")  # the bodies with an id_slot


def replica_tag(replica_id: str) -> str:
    """The tag a replica writes into its stored responses' ids: 8 hex digits of its id."""
    return hashlib.blake2b(replica_id.encode(), digest_size=4).hexdigest()


def affinity(method: str, path: str, body: bytes) -> str | None:
    """The replica tag a request must go to (it names something a replica stored), or
    None. Only /v1/responses reads its body (bounded by --max-body), as JSON, no more."""
    if path.startswith(_RESPONSES + "/"):  # GET, DELETE, .../input_items, .../cancel
        return responses_api.tag_of(path[len(_RESPONSES) + 1 :].split("/", 1)[0])
    if method != "POST" or path != _RESPONSES:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None
    if not isinstance(data, dict):
        return None
    named = [data.get("previous_response_id")]
    if isinstance(data.get("input"), list):
        named += [i.get("id") for i in data["input"]
                  if isinstance(i, dict) and i.get("type") == "item_reference"]  # fmt: skip
    return next((tag for n in named if isinstance(n, str) and (tag := responses_api.tag_of(n))),
                None)  # fmt: skip


def slot_of(method: str, path: str, body: bytes) -> int | None:
    """The llama-server slot a request names, or None: POST /slots/N (N a decimal of at
    most 9 digits; the replica checks it is one of its slots), or a completion's or
    chat's `id_slot` >= 0 (the body read as JSON only where it holds the name)."""
    if path.startswith(_SLOTS):
        n = path[len(_SLOTS) :]
        return int(n) if method == "POST" and n.isascii() and n.isdigit() and len(n) <= 9 else None
    if method != "POST" or path not in _SLOTTED or b'"id_slot"' not in body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    n = data.get("id_slot") if isinstance(data, dict) else None
    return n if type(n) is int and 0 <= n < 10**9 else None


def route_key(
    path: str, body: bytes, tokenizer: Tokenizer, block_size: int, blocks: int = ROUTE_BLOCKS
) -> bytes | None:
    """The key of a request to `path` with this JSON body, or None (nothing to route by)."""
    model = _BODIES.get(path)
    if model is None:
        return None
    try:
        request = model.model_validate_json(body)
        if isinstance(request, MessagesRequest):  # the chat it means (as the replica runs it)
            request = anthropic.to_chat(request)
        elif isinstance(request, (ollama.ChatRequest, ollama.GenerateRequest)):
            request = _ollama(request)
        elif isinstance(request, ResponsesRequest):  # one naming nothing stored (else affinity)
            if request.previous_response_id is not None:
                return None
            given = responses_api.input_items(request)
            # nothing expands here (a reference finds no stored item): no bound to hold
            messages = responses_api.conversation(given, _none, room=sys.maxsize)
            request = responses_api.to_chat(request, messages)
        return chain_key(prompt_ids(request, tokenizer), request.cache_salt, block_size, blocks)
    except (ValueError, KvlmError, struct.error):  # pydantic's ValidationError is a ValueError;
        return None  # struct.error: a token id past 2**32 (the replica says which)


def _ollama(
    request: ollama.ChatRequest | ollama.GenerateRequest,
) -> ChatCompletionRequest | CompletionRequest:
    """The chat (or, a raw generate, the completion) an Ollama body means, as the replica
    reads it (kvlm.server.app ollama_routes; the model's name is the replica's to check)."""
    if isinstance(request, ollama.ChatRequest):
        return ollama.to_chat(request, request.model)
    if request.raw:
        return ollama.to_completion(request, request.model)
    return ollama.generate_chat(request, request.model)


def _none(_: str) -> None:  # no stored item is known here (a reference: affinity routes)
    return None


def prompt_ids(
    request: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer
) -> list[int]:
    """The token ids the replica will run: the chat rendered as kvlm.server.app renders it,
    or a completion's (first) prompt."""
    if isinstance(request, ChatCompletionRequest):
        return request.prompt_ids(tokenizer)
    first = request.prompts()[0]
    return first if isinstance(first, list) else tokenizer.encode(first)


def chain_key(ids: list[int], salt: str | None, block_size: int, blocks: int) -> bytes | None:
    """The chained key of the first min(blocks, full blocks) blocks; None if none is full."""
    full = min(len(ids) // block_size, blocks)
    if full == 0:
        return None
    key = root_key(salt)
    for i in range(full):
        key = block_key(key, tuple(ids[i * block_size : (i + 1) * block_size]))
    return key
