"""The small model's corpus, written by the project itself (no downloaded text).

Conversations in the message form `streamrt.chat` renders to XTML (think channel on):

- facts: "What is the capital of X?" and two other phrasings, think + answer;
- weather: get_weather declared, the call emitted, the tool result, a final answer quoting
  it. Tool results are drawn per conversation, so the final answer must be copied from
  the tool message, not remembered per city;
- a little plain text (a few fixed questions about streamrt, a greeting).

Everything comes from the tables below with a seeded RNG, so the corpus is reproducible.

What "held-out" means here (be precise, the tests rely on it):
- `heldout` prompts use a phrasing (template) that never occurs in training, over the
  same countries / training cities. The answer forms are the trained ones.
- `unseen_city` prompts ask for the weather in cities that never occur in training at
  all, with a trained phrasing: the model must copy the city name from the prompt.
"""

from __future__ import annotations

import json
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

# Training cities (at least 20, so held-out cities test generalisation) and cities never seen in training.
CITIES = [
    "Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Dublin",
    "Vienna", "Athens", "Moscow", "Seoul", "Sydney", "Toronto", "Chicago", "Boston", "Denver", "Miami",
    "Nairobi", "Lagos", "Mumbai", "Delhi", "Bangkok", "Hanoi", "Havana", "Quito", "Bogota", "Lisbon",
]
UNSEEN_CITIES = ["Prague", "Zurich", "Osaka", "Dallas", "Manila", "Kyiv", "Accra", "Perth"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

FACT_TRAIN = ["What is the capital of {c}?", "Name the capital of {c}."]
FACT_ONE_WORD = "What is the capital of {c}? Answer in one word."  # also the selfcheck control prompt
FACT_HELDOUT = ["Which city is the capital of {c}?"]
WEATHER_TRAIN = ["What's the weather in {city}?", "How is the weather in {city} today?", "Weather in {city}, please."]
WEATHER_HELDOUT = ["Tell me the weather in {city}."]

PLAIN = [
    ("Hello!", "Hello! Ask me about capitals or the weather."),
    ("What is streamrt?", "streamrt runs Kimi models by streaming routed experts from a host store."),
    ("What is KDA?", "Kimi Delta Attention keeps a recurrent state per head."),
    ("What does the indexer do?", "The Lightning Indexer keeps the best keys per query for MLA."),
    ("Who are you?", "I am a small Kimi K3.1 Pro model trained by streamrt."),
]


@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict] | None = None
    split: str = "train"  # train | heldout | unseen_city
    kind: str = "fact"  # fact | weather | plain
    meta: dict = field(default_factory=dict)


def weather_result(city: str, variant: int = 0) -> dict:
    """A deterministic fake observation per (city, variant), so answers are checkable."""
    h = sum(ord(ch) * (i + 1) for i, ch in enumerate(city)) + 7919 * variant
    return {"city": city, "condition": CONDITIONS[(h // 7) % len(CONDITIONS)], "temperature_c": 5 + h % 26}


def tool_content(result: dict) -> str:
    return json.dumps(result, separators=(",", ":"), sort_keys=True)


def final_answer(result: dict) -> str:
    return f"It is {result['temperature_c']} C and {result['condition']} in {result['city']}."


def weather_call(city: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def fact_conversation(country: str, template: str, split: str) -> Conversation:
    cap = CAPITALS[country]
    answer = f"{cap}." if template == FACT_ONE_WORD else f"The capital of {country} is {cap}."
    return Conversation(
        messages=[
            {"role": "user", "content": template.format(c=country)},
            {"role": "assistant", "reasoning": f"{country}: {cap}.", "content": answer},
        ],
        split=split, kind="fact", meta={"country": country, "answer": cap},
    )


def weather_conversation(
    city: str, template: str, split: str, variant: int = 0, result: dict | None = None
) -> Conversation:
    r = result or weather_result(city, variant)
    return Conversation(
        messages=[
            {"role": "user", "content": template.format(city=city)},
            {"role": "assistant", "reasoning": f"I need the weather in {city}.", "content": "",
             "tool_calls": [weather_call(city)]},
            {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": tool_content(r)},
            {"role": "assistant", "reasoning": "The tool answered.", "content": final_answer(r)},
        ],
        tools=[WEATHER_TOOL], split=split, kind="weather", meta={"city": city, "result": r},
    )


def plain_conversation(q: str, a: str) -> Conversation:
    return Conversation(
        messages=[{"role": "user", "content": q}, {"role": "assistant", "reasoning": "", "content": a}],
        kind="plain", meta={"answer": a},
    )


WEATHER_VARIANTS = 4  # tool results per (city, phrasing) in the training set


def build_corpus(seed: int = 0) -> list[Conversation]:
    """Every conversation: split 'train' (the training set), 'heldout', 'unseen_city'."""
    rng = random.Random(seed)
    out: list[Conversation] = []
    for country in CAPITALS:
        for t in FACT_TRAIN + [FACT_ONE_WORD]:
            out.append(fact_conversation(country, t, "train"))
        out.append(fact_conversation(country, FACT_HELDOUT[0], "heldout"))
    for city in CITIES:
        for j, t in enumerate(WEATHER_TRAIN):
            for v in range(WEATHER_VARIANTS):
                out.append(weather_conversation(city, t, "train", variant=j * WEATHER_VARIANTS + v))
        out.append(weather_conversation(city, WEATHER_HELDOUT[0], "heldout", variant=99))
    for city in UNSEEN_CITIES:
        out.append(weather_conversation(city, WEATHER_TRAIN[0], "unseen_city", variant=0))
    for q, a in PLAIN:
        out.append(plain_conversation(q, a))
    rng.shuffle(out)
    return out


def split(corpus: list[Conversation], name: str, kind: str | None = None) -> list[Conversation]:
    return [c for c in corpus if c.split == name and (kind is None or c.kind == kind)]


# ---- synthetic cities (training only): random names force the model to copy, not recall ----

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "tr", "kh", "ch"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]


def synthetic_city(rng: random.Random) -> str:
    while True:
        name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))
        if rng.random() < 0.4:
            name += rng.choice(["n", "r", "s", "l"])
        name = name.capitalize()
        if name not in CITIES and name not in UNSEEN_CITIES:
            return name


def synthetic_weather(rng: random.Random) -> Conversation:
    """A weather exchange about a random made-up city, with a random tool result."""
    city = synthetic_city(rng)
    r = {"city": city, "condition": rng.choice(CONDITIONS), "temperature_c": rng.randint(-5, 35)}
    return weather_conversation(city, rng.choice(WEATHER_TRAIN), "synthetic", result=r)


COPY_TEMPLATES = ["Repeat the word {w}.", "Say {w}.", "Spell {w} for me."]


def copy_conversation(rng: random.Random) -> Conversation:
    """A short copy exercise (training only): the answer repeats a name from the prompt."""
    pick = rng.random()
    if pick < 0.6:
        w = synthetic_city(rng)
    elif pick < 0.8:
        w = rng.choice(CITIES + list(CAPITALS.values()))
    else:
        w = rng.choice(list(CAPITALS))
    return Conversation(
        messages=[{"role": "user", "content": rng.choice(COPY_TEMPLATES).format(w=w)},
                  {"role": "assistant", "reasoning": f"The word is {w}.", "content": f"{w}."}],
        split="synthetic", kind="copy", meta={"answer": w},
    )


def number_copy_conversation(rng: random.Random) -> Conversation:
    """A short number copy exercise (training only): the answer repeats a number from the prompt,
    drawn like the tool results' temperatures (-5..35) or wider (0..99), so digits are copied."""
    n = rng.randint(-5, 35) if rng.random() < 0.7 else rng.randint(0, 99)
    return Conversation(
        messages=[{"role": "user", "content": rng.choice(COPY_TEMPLATES).format(w=n)},
                  {"role": "assistant", "reasoning": f"The number is {n}.", "content": f"{n}."}],
        split="synthetic", kind="copy", meta={"answer": str(n)},
    )
