"""docs/API.md's field tables say what the code takes: for each endpoint, the fields the
tables name (first column, in backticks) are exactly its request model's fields, so a
field added to the code without a line in the docs (or a line for a field that is gone)
fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlm.server import ollama
from kvlm.server.anthropic import MessagesRequest
from kvlm.server.protocol import ChatCompletionRequest, CompletionRequest
from kvlm.server.responses_api import ResponsesRequest

API = Path(__file__).resolve().parent.parent / "docs" / "API.md"
NAME = re.compile(r"`([a-z_][a-z0-9_]*)(?:\.[a-z_.]+)?`")


def documented() -> dict[str, set[str]]:
    """Each `## ` section's names: the backticked field names of its tables' first
    column (`a.b` counts as `a`)."""
    out: dict[str, set[str]] = {}
    section = ""
    for line in API.read_text("utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            out[section] = set()
        elif line.startswith("| ") and not line.startswith("| ---"):
            first = line.split("|")[1]
            out[section] |= set(NAME.findall(first))
    return out


def fields(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


@pytest.mark.parametrize("model, sections", [
    (ChatCompletionRequest, ["Both endpoints", "/v1/chat/completions"]),
    (CompletionRequest, ["Both endpoints", "/v1/completions"]),
    (ResponsesRequest, ["/v1/responses (OpenAI's Responses API)"]),
    (MessagesRequest, ["/v1/messages (Anthropic's Messages API)"]),
    (ollama.ChatRequest, ["Ollama: /api/chat and /api/generate", "Ollama: /api/chat"]),
    (ollama.GenerateRequest, ["Ollama: /api/chat and /api/generate", "Ollama: /api/generate"]),
    (ollama.Options, ["Ollama: options"]),
])  # fmt: skip
def test_each_endpoints_table_names_its_fields(model, sections):
    docs = documented()
    named = set().union(*(docs[s] for s in sections)) - {"field"}
    assert named == fields(model), (
        f"in the code, not the docs: {sorted(fields(model) - named)}; "
        f"in the docs, not the code: {sorted(named - fields(model))}"
    )
