"""The chat corpus: what makes the small model behave like a small chat model.

Generated from the tables below with a seeded RNG (no downloaded text). Every sampler takes a
`split`: "train" draws phrasings, system prompts, cities and unknown countries from the
training tables only, "heldout" from the held-out ones (disjoint from training, so an
evaluation measures generalisation, not recall). Capitals themselves are knowledge: the
held-out capital questions ask about the 30 trained countries with held-out phrasings and
system prompts.

Kinds (Conversation.kind):
- capital: one question, answered "The capital of X is Y.";
- followup: a capital question then "And of Norway?" (the second turn needs the first);
- unknown: a capital question about a country the model does not know: "I don't know.";
- greeting: "Hello" and the like;
- json: a capital question with `response_format` json_object: {"capital":..,"country":..};
- tool_loop: get_weather / get_time declared (one or both), the call, the result, an answer
  quoting it, then a second question in context ("And in Tokyo?"): a second call and answer;
- parallel: "What's the weather in A and B?": two calls in one message, two results, one answer.
Each may carry a system prompt (none, short, long, a role, tool instructions); the answer
never depends on it. `meta["render"]` holds extra `encode_chat` keywords (response_format).
"""

from __future__ import annotations

import json
import random

from corpus import CAPITALS, CITIES, CONDITIONS, UNSEEN_CITIES, WEATHER_TOOL, Conversation, synthetic_city

ROLES = {
    "train": [
        "You are a helpful assistant.",
        "You are Kimi, an AI assistant.",
        "You are a travel agent helping customers plan their trips.",
        "You are a geography teacher talking to your students.",
        "You are a customer support assistant for an airline.",
        "You are a friendly assistant in a mobile app.",
        "You are an assistant that answers questions about places and the weather.",
        "You are a concise assistant.",
    ],
    "heldout": [
        "You are an assistant for a school quiz app.",
        "You are a chatbot on a hotel website.",
        "You are a polite assistant who works for a tour company.",
    ],
}
RULES = {
    "train": [
        "Answer briefly.",
        "Keep answers short and polite.",
        "Do not use markdown.",
        "Use the tools when you need live data, and report exactly what they return.",
        "Never guess the weather: call get_weather instead.",
        "If you do not know something, say so.",
        "Always answer in English, in one sentence.",
        "Be accurate and friendly.",
    ],
    "heldout": [
        "Give short, correct answers.",
        "Call a tool whenever the question needs current information.",
        "Say so when you are not sure.",
    ],
}


def system_prompt(rng: random.Random, split: str) -> str:
    """A role, rules, or both: from one rule to a long paragraph."""
    roles, rules = ROLES[split], RULES[split]
    pick = rng.random()
    if pick < 0.3:
        return rng.choice(roles)
    if pick < 0.45:
        return rng.choice(rules)
    n = rng.randint(1, min(3, len(rules)))
    return " ".join([rng.choice(roles)] + rng.sample(rules, n))


CAPITAL_Q = {
    "train": ["What is the capital of {c}?", "Name the capital of {c}.", "What's the capital of {c}?",
              "Tell me the capital of {c}.", "capital of {c}?"],
    "heldout": ["Which city is the capital of {c}?", "What city is the capital of {c}?"],
}
FOLLOWUP_Q = {
    "train": ["And of {c}?", "And {c}?", "What about {c}?", "And the capital of {c}?"],
    "heldout": ["How about {c}?", "And what about {c}?"],
}
# Countries whose capital the model is not taught: real ones and made-up ones.
UNKNOWN_REAL = {
    "train": ["Nepal", "Ghana", "Chad", "Laos", "Fiji", "Oman", "Mali", "Iceland", "Bolivia", "Mongolia",
              "Zambia", "Latvia", "Qatar", "Jamaica", "Uganda", "Estonia"],
    "heldout": ["Bhutan", "Yemen", "Malta", "Belize", "Gabon", "Nauru"],
}
_COUNTRY_ENDINGS = ["ia", "land", "stan", "ia", "ova", "ania"]
HELDOUT_MADE_UP = ["Zorvania", "Kelmaristan", "Drovia", "Talomberland", "Vushkova", "Merandia"]
IDK = "I don't know."
GREETINGS = {
    "train": ["Hello!", "Hello", "Hi", "Hi!", "Hey", "Good morning!", "Hey there!", "hello"],
    "heldout": ["Hi there!", "Good evening!", "Hello there."],
}
GREETING_ANSWER = "Hello! Ask me about capitals or the weather."
WEATHER_Q = {
    "train": ["What's the weather in {city}?", "How is the weather in {city} today?", "Weather in {city}, please.",
              "Is it cold in {city}?", "What is the weather like in {city}?"],
    "heldout": ["Tell me the weather in {city}.", "Could you check the weather in {city}?"],
}
WEATHER_FOLLOWUP = {
    "train": ["And in {city}?", "What about {city}?", "And {city}?"],
    "heldout": ["How about {city}?", "And the weather in {city}?"],
}
TIME_Q = {
    "train": ["What time is it in {city}?", "What's the time in {city}?", "Current time in {city}?"],
    "heldout": ["Tell me the time in {city}."],
}
PARALLEL_Q = {
    "train": ["What's the weather in {a} and {b}?", "Weather in {a} and {b}, please."],
    "heldout": ["Tell me the weather in {a} and in {b}."],
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_SETS = [[WEATHER_TOOL], [WEATHER_TOOL, TIME_TOOL], [TIME_TOOL, WEATHER_TOOL]]
HELDOUT_CITIES = UNSEEN_CITIES + ["Geneva", "Nagoya", "Austin", "Porto"]
REAL_CITIES = sorted(set(CITIES) | set(CAPITALS.values()))


def unknown_country(rng: random.Random, split: str) -> str:
    if split == "heldout":
        return rng.choice(UNKNOWN_REAL["heldout"] + HELDOUT_MADE_UP)
    if rng.random() < 0.4:
        return rng.choice(UNKNOWN_REAL["train"])
    while True:
        name = synthetic_city(rng).rstrip("aeiou") + rng.choice(_COUNTRY_ENDINGS)
        if name not in HELDOUT_MADE_UP and name not in CAPITALS:
            return name


def city(rng: random.Random, split: str) -> str:
    """Held-out: real cities never in training. Train: real cities, or made-up ones (copying)."""
    if split == "heldout":
        return rng.choice(HELDOUT_CITIES)
    if rng.random() < 0.6:
        return rng.choice(REAL_CITIES)
    while True:
        name = synthetic_city(rng)
        if name not in HELDOUT_CITIES:
            return name


# ---- messages ---------------------------------------------------------------------------


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def said(reasoning: str, content: str) -> dict:
    return {"role": "assistant", "reasoning": reasoning, "content": content}


def capital_answer(country: str) -> dict:
    if country in CAPITALS:
        return said(f"{country}: {CAPITALS[country]}.", f"The capital of {country} is {CAPITALS[country]}.")
    return said("I do not know this country.", IDK)


def call(name: str, city_: str, index: int) -> dict:
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": {"city": city_}}}


def tool_result(rng: random.Random, name: str, city_: str) -> dict:
    if name == "get_weather":
        return {"city": city_, "condition": rng.choice(CONDITIONS), "temperature_c": rng.randint(-5, 35)}
    return {"city": city_, "time": f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"}


def result_text(name: str, r: dict) -> str:
    if name == "get_weather":
        return f"It is {r['temperature_c']} C and {r['condition']} in {r['city']}."
    return f"It is {r['time']} in {r['city']}."


def tool_message(name: str, r: dict, index: int) -> dict:
    content = json.dumps(r, separators=(",", ":"), sort_keys=True)
    return {"role": "tool", "name": name, "tool_call_id": f"call_{index}", "content": content}


def tool_turn(rng: random.Random, name: str, city_: str, index: int) -> list[dict]:
    """Call, result, answer quoting the result (call ids count on through the conversation)."""
    what = "weather" if name == "get_weather" else "time"
    r = tool_result(rng, name, city_)
    return [
        {"role": "assistant", "reasoning": f"I need the {what} in {city_}.", "content": "",
         "tool_calls": [call(name, city_, index)]},
        tool_message(name, r, index),
        said("The tool answered.", result_text(name, r)),
    ]


# ---- conversations ----------------------------------------------------------------------


def with_system(rng: random.Random, split: str, messages: list[dict], p_system: float) -> tuple[list[dict], bool]:
    if rng.random() < p_system:
        return [{"role": "system", "content": system_prompt(rng, split)}] + messages, True
    return messages, False


def sample_capital(rng, split):
    c = rng.choice(list(CAPITALS))
    return [user(rng.choice(CAPITAL_Q[split]).format(c=c)), capital_answer(c)], None, {}


def sample_unknown(rng, split):
    c = unknown_country(rng, split)
    return [user(rng.choice(CAPITAL_Q[split]).format(c=c)), capital_answer(c)], None, {}


def sample_followup(rng, split):
    a, b = rng.sample(list(CAPITALS), 2)
    if split == "train" and rng.random() < 0.15:
        b = unknown_country(rng, split)
    msgs = [user(rng.choice(CAPITAL_Q[split]).format(c=a)), capital_answer(a),
            user(rng.choice(FOLLOWUP_Q[split]).format(c=b)), capital_answer(b)]
    return msgs, None, {}


def sample_greeting(rng, split):
    return [user(rng.choice(GREETINGS[split])), said("", GREETING_ANSWER)], None, {}


def sample_json(rng, split):
    c = rng.choice(list(CAPITALS))
    body = json.dumps({"capital": CAPITALS[c], "country": c}, separators=(",", ":"))
    msgs = [user(rng.choice(CAPITAL_Q[split]).format(c=c)), said(f"{c}: {CAPITALS[c]}.", body)]
    return msgs, None, {"render": {"response_format": {"type": "json_object"}}}


def sample_tool_loop(rng, split):
    tools = rng.choice(TOOL_SETS)
    names = [t["function"]["name"] for t in tools]
    a, b = city(rng, split), city(rng, split)
    first = rng.choice(names)
    second = first if rng.random() < 0.7 else rng.choice(names)
    q1 = (WEATHER_Q if first == "get_weather" else TIME_Q)[split]
    msgs = [user(rng.choice(q1).format(city=a))] + tool_turn(rng, first, a, 1)
    if second == first:
        msgs.append(user(rng.choice(WEATHER_FOLLOWUP[split]).format(city=b)))
    else:
        msgs.append(user(rng.choice((WEATHER_Q if second == "get_weather" else TIME_Q)[split]).format(city=b)))
    if rng.random() < 0.2 and split == "train":  # a capital question in a tool conversation: no call
        c = rng.choice(list(CAPITALS))
        msgs[-1] = user(rng.choice(CAPITAL_Q[split]).format(c=c))
        return msgs + [capital_answer(c)], tools, {}
    return msgs + tool_turn(rng, second, b, 2), tools, {}


def sample_parallel(rng, split):
    a, b = city(rng, split), city(rng, split)
    while b == a:
        b = city(rng, split)
    ra, rb = tool_result(rng, "get_weather", a), tool_result(rng, "get_weather", b)
    msgs = [user(rng.choice(PARALLEL_Q[split]).format(a=a, b=b)),
            {"role": "assistant", "reasoning": f"I need the weather in {a} and {b}.", "content": "",
             "tool_calls": [call("get_weather", a, 1), call("get_weather", b, 2)]},
            tool_message("get_weather", ra, 1), tool_message("get_weather", rb, 2),
            said("The tools answered.", result_text("get_weather", ra) + " " + result_text("get_weather", rb))]
    return msgs, rng.choice(TOOL_SETS), {}


SAMPLERS = {"capital": sample_capital, "unknown": sample_unknown, "followup": sample_followup,
            "greeting": sample_greeting, "json": sample_json, "tool_loop": sample_tool_loop,
            "parallel": sample_parallel}
TRAIN_MIX = {"capital": 0.16, "unknown": 0.14, "followup": 0.16, "greeting": 0.06, "json": 0.06,
             "tool_loop": 0.3, "parallel": 0.12}


def sample_chat(rng: random.Random, split: str = "train", kind: str | None = None,
                p_system: float = 0.6) -> Conversation:
    """One conversation of `kind` (default: drawn by TRAIN_MIX), with a system prompt at p_system."""
    if kind is None:
        kind = rng.choices(list(TRAIN_MIX), weights=list(TRAIN_MIX.values()))[0]
    msgs, tools, meta = SAMPLERS[kind](rng, split)
    msgs, has_system = with_system(rng, split, msgs, p_system)
    return Conversation(messages=msgs, tools=tools, split=split, kind=kind, meta={**meta, "system": has_system})


def client_view(conv: Conversation) -> Conversation:
    """The conversation as an API client sends it back: the reasoning of assistant turns before
    the last user message dropped. meta["train_from"]: the first message index to learn."""
    last_user = max(i for i, m in enumerate(conv.messages) if m["role"] == "user")
    msgs = [({k: v for k, v in m.items() if k not in ("reasoning", "reasoning_content")}
             if m["role"] == "assistant" and i < last_user else m) for i, m in enumerate(conv.messages)]
    return Conversation(messages=msgs, tools=conv.tools, split=conv.split, kind=conv.kind,
                        meta={**conv.meta, "train_from": last_user + 1})
