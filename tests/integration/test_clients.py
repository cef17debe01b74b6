"""A widely used client against the shared real server: langchain-openai's
``with_structured_output`` (a strict ``json_schema`` response format) and ``bind_tools``
(``tools`` with ``tool_choice``), invoked and streamed."""

from __future__ import annotations

import jsonschema
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=130)


class GetWeather(BaseModel):
    """Get the current weather of a city."""

    city: str = Field(max_length=20, description="the city")
    unit: str = Field(json_schema_extra={"enum": ["celsius", "fahrenheit"]})


@pytest.fixture(scope="module")
def chat(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.base_url + "/v1", api_key="x", model=MODEL,
                      temperature=0, max_tokens=80, max_retries=0, timeout=300)


@pytest.mark.timeout(300)
def test_with_structured_output(chat) -> None:
    structured = chat.with_structured_output(Person)  # method "json_schema", strict
    person = structured.invoke("Describe a fictional person.")
    assert isinstance(person, Person)
    raw = chat.with_structured_output(Person, include_raw=True).invoke("Describe a person.")
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Person)


@pytest.mark.timeout(300)
def test_bind_tools_invoke_and_stream(chat) -> None:
    schema = GetWeather.model_json_schema()
    bound = chat.bind_tools([GetWeather], tool_choice="any")  # "required" on the wire
    msg = bound.invoke("What's the weather in Paris?")
    assert msg.tool_calls, msg
    for call in msg.tool_calls:
        assert call["name"] == "GetWeather" and call["id"]
        jsonschema.validate(call["args"], schema)
    named = chat.bind_tools([GetWeather], tool_choice="GetWeather")
    chunks = list(named.stream("What's the weather in Lima?"))
    assert len(chunks) > 1
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    (call,) = total.tool_calls
    assert call["name"] == "GetWeather"
    jsonschema.validate(call["args"], schema)
