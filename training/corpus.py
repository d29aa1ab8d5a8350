"""The small model's corpus, written by the project itself (no downloaded text).

Three kinds of conversation, all in the message form `streamrt.chat` renders to XTML:
short factual exchanges with a think channel, get_weather tool exchanges (tool declared,
call emitted, tool result, final answer quoting it), and a little plain text. Everything
is generated from tables below with a seeded RNG, so the corpus is reproducible.

Held-out prompts use phrasings the training set never pairs with that fact or city, so a
pass there means the model generalised the form, not that it memorised the string.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia", "Peru": "Lima", "Chile": "Santiago",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens",
    "Austria": "Vienna", "Ireland": "Dublin", "Russia": "Moscow", "Turkey": "Ankara", "Iran": "Tehran",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "Australia": "Canberra", "Argentina": "Buenos Aires",
    "Cuba": "Havana",
}

CITIES = [
    "Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Dublin",
    "Vienna", "Athens", "Moscow", "Seoul", "Sydney", "Toronto", "Chicago", "Boston", "Denver", "Miami",
    "Nairobi", "Lagos", "Mumbai", "Delhi", "Bangkok", "Hanoi", "Havana", "Quito", "Bogota", "Lisbon",
]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}

FACT_TRAIN = ["What is the capital of {c}?", "Name the capital of {c}."]
FACT_HELDOUT = ["Which city is the capital of {c}?"]
WEATHER_TRAIN = ["What's the weather in {city}?", "How is the weather in {city} today?"]
WEATHER_HELDOUT = ["Tell me the weather in {city}."]

PLAIN = [
    "streamrt runs KimiLinear models by streaming routed experts from a host store.",
    "Kimi Delta Attention keeps a recurrent state per head; MLA keeps a latent per token.",
    "The Lightning Indexer keeps the best keys per query and MLA attends to those only.",
    "Attention residuals mix earlier blocks by depth before each sublayer.",
]


@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict] | None = None
    split: str = "train"  # train | heldout
    kind: str = "fact"  # fact | weather | plain
    meta: dict = field(default_factory=dict)


def weather_result(city: str) -> dict:
    """A deterministic fake observation per city, so answers are checkable."""
    h = sum(ord(ch) * (i + 1) for i, ch in enumerate(city))
    return {"city": city, "temperature_c": 5 + h % 26, "condition": CONDITIONS[h % len(CONDITIONS)]}


def fact_conversation(country: str, template: str, split: str) -> Conversation:
    cap = CAPITALS[country]
    return Conversation(
        messages=[
            {"role": "user", "content": template.format(c=country)},
            {"role": "assistant", "reasoning": f"The capital of {country} is {cap}.",
             "content": f"The capital of {country} is {cap}."},
        ],
        split=split, kind="fact", meta={"country": country, "answer": cap},
    )


def weather_conversation(city: str, template: str, split: str) -> Conversation:
    r = weather_result(city)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": city}}}
    return Conversation(
        messages=[
            {"role": "user", "content": template.format(city=city)},
            {"role": "assistant", "reasoning": f"I need the weather in {city}.", "content": "",
             "tool_calls": [call]},
            {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": r},
            {"role": "assistant", "reasoning": "The tool answered.",
             "content": f"It is {r['temperature_c']} C and {r['condition']} in {city}."},
        ],
        tools=[WEATHER_TOOL], split=split, kind="weather", meta={"city": city, "result": r},
    )


def build_corpus(seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed)
    out: list[Conversation] = []
    for country in CAPITALS:
        for t in FACT_TRAIN:
            out.append(fact_conversation(country, t, "train"))
        out.append(fact_conversation(country, FACT_HELDOUT[0], "heldout"))
    for city in CITIES:
        for t in WEATHER_TRAIN:
            out.append(weather_conversation(city, t, "train"))
        out.append(weather_conversation(city, WEATHER_HELDOUT[0], "heldout"))
    for text in PLAIN:
        out.append(Conversation(messages=[{"role": "user", "content": "Say something about streamrt."},
                                          {"role": "assistant", "reasoning": "", "content": text}],
                                kind="plain"))
    rng.shuffle(out)
    return out
