"""LangChain (langchain-openai) against `kvlm serve`, with its defaults: ChatOpenAI invoke,
stream, batch, with_structured_output (json_schema; the result validates) and bind_tools
(a tool call parsed, a ToolMessage reply continued); the completions class OpenAI invoke
and stream (it sends frequency_penalty / presence_penalty / n / best_of by default)."""

from __future__ import annotations

import pytest

from helpers import CHATML_TOOLS, save_tiny_model
from serving import kvlm_serve

langchain_openai = pytest.importorskip("langchain_openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server():
    with kvlm_serve("--max-context", "1024", "--threads", "2") as (port, _):
        yield f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("lc-tools"), "qwen3", seed=3,
                             chat_template=CHATML_TOOLS, max_position_embeddings=2048)  # fmt: skip
    with kvlm_serve("--model", str(folder), "--max-context", "2048", "--threads", "2") as (p, _):
        yield f"http://127.0.0.1:{p}/v1", folder.name


def chat(url, model="SmolLM2-135M-Instruct.Q4_1.gguf", **kw):
    return langchain_openai.ChatOpenAI(base_url=url, api_key="unused", model=model,
                                       max_retries=0, **kw)  # fmt: skip


def test_chat_invoke_stream_and_batch(default_server):
    llm = chat(default_server, temperature=0, max_tokens=12)
    whole = llm.invoke("What is the capital of Japan?")
    assert "Tokyo" in whole.content
    assert whole.response_metadata["finish_reason"] in ("stop", "length")
    streamed = "".join(chunk.content for chunk in llm.stream("What is the capital of Japan?"))
    assert streamed == whole.content
    many = llm.batch(["What is the capital of Japan?", "Name a colour."])
    assert many[0].content == whole.content and many[1].content


def test_chat_with_structured_output(default_server):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    llm = chat(default_server, temperature=0, max_tokens=60)
    structured = llm.with_structured_output(City, method="json_schema", strict=True)
    city = structured.invoke("Name a city and its country.")
    assert isinstance(city, City) and city.name


def test_bind_tools_and_continue_with_the_tools_reply(tools_server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from pydantic import BaseModel, Field

    class Where(BaseModel):
        # bounded: a random-weight model, held to the schema, may fill a string to the end
        city: str = Field(max_length=12)

    @tool(args_schema=Where)
    def weather(city: str) -> str:
        """The weather now in a city."""
        return f"Sunny in {city}"

    url, model = tools_server
    llm = chat(url, model=model, temperature=0, max_tokens=60)
    caller = llm.bind_tools([weather], tool_choice="weather")
    asked = HumanMessage("What is the weather in Paris?")
    reply = caller.invoke([asked])
    assert len(reply.tool_calls) == 1 and reply.tool_calls[0]["name"] == "weather"
    args = reply.tool_calls[0]["args"]
    assert isinstance(args.get("city"), str)
    answer = ToolMessage(weather.invoke(args), tool_call_id=reply.tool_calls[0]["id"])
    final = llm.bind_tools([weather]).invoke([asked, reply, answer])
    assert final.tool_calls == [] and isinstance(final.content, str)


def test_completions_class_with_its_defaults(default_server):
    llm = langchain_openai.OpenAI(base_url=default_server, api_key="unused", max_retries=0,
                                  model="SmolLM2-135M-Instruct.Q4_1.gguf", temperature=0,
                                  max_tokens=8)  # fmt: skip
    text = llm.invoke("The capital of France is")
    assert text and "".join(llm.stream("The capital of France is")) == text
