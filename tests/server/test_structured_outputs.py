"""``response_format`` through the real server: every finished output parses and validates."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, Field

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["engineer", "artist", "doctor"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe Ann, a 34 year old engineer from Lyon, as JSON."}]


def person_format() -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_json_schema_nested_enum_array_required(client: Any, model_name: str) -> None:
    r = client.chat.completions.create(model=model_name, messages=ASK, temperature=0, max_tokens=120,
                                       response_format=person_format())
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, PERSON)


def test_json_schema_streamed_equals_whole(client: Any, model_name: str) -> None:
    whole = client.chat.completions.create(model=model_name, messages=ASK, temperature=0, max_tokens=120,
                                           response_format=person_format())
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model_name, messages=ASK, temperature=0, max_tokens=120, response_format=person_format(),
        stream=True) if c.choices]
    assert "".join(parts) == whole.choices[0].message.content


def test_json_object(client: Any, model_name: str) -> None:
    ask = [{"role": "user", "content": "Give me a JSON object describing a cat."}]
    r = client.chat.completions.create(model=model_name, temperature=0, max_tokens=80, messages=ask,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_short_budget_still_closes_the_json(client: Any, model_name: str) -> None:
    """The small model would keep adding keys; near max_tokens the grammar steers to the end."""
    r = client.chat.completions.create(model=model_name, temperature=0, max_tokens=24,
                                       messages=[{"role": "user", "content": "Describe a city in JSON."}],
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.usage.completion_tokens <= 24


class Pet(BaseModel):
    name: str = Field(max_length=30)
    species: Literal["cat", "dog", "bird"]
    age_years: int = Field(ge=0, le=40)


def test_chat_completions_parse_pydantic(client: Any, model_name: str) -> None:
    r = client.chat.completions.parse(model=model_name, temperature=0, max_tokens=60, response_format=Pet,
                                      messages=[{"role": "user", "content": "Invent a pet and describe it."}])
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet)
    assert pet.species in ("cat", "dog", "bird")


def test_sampled_choices_all_validate(client: Any, model_name: str) -> None:
    r = client.chat.completions.create(model=model_name, messages=ASK, temperature=1.0, seed=11, n=3,
                                       max_tokens=120, response_format=person_format())
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_legacy_completions_json_schema(client: Any, model_name: str) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    r = client.completions.create(model=model_name, prompt="Q: What is 2 + 2? Answer in JSON.\nA: ", max_tokens=30,
                                  temperature=0, extra_body={"response_format": {
                                      "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
