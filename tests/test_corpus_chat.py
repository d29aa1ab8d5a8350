"""The chat corpus (training/corpus_chat.py): held-out tables never leak into training, the answer
never depends on the system prompt, and the client view learns only the last turn."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

import corpus_chat as CC  # noqa: E402
import train_small as T  # noqa: E402

from streamrt.tokenizer import ByteTokenizer  # noqa: E402


def _texts(conv) -> str:
    return json.dumps([conv.messages, conv.tools])


def test_heldout_prompts_cities_and_countries_never_occur_in_training():
    rng = random.Random(7)
    train = "\n".join(_texts(CC.sample_chat(rng, "train")) for _ in range(3000))
    held_sentences = CC.ROLES["heldout"] + CC.RULES["heldout"] + CC.GREETINGS["heldout"]
    held_names = CC.HELDOUT_CITIES + CC.UNKNOWN_REAL["heldout"] + CC.HELDOUT_MADE_UP
    for s in held_sentences + held_names:
        assert s not in train, s
    for table in (CC.CAPITAL_Q, CC.FOLLOWUP_Q, CC.WEATHER_Q, CC.WEATHER_FOLLOWUP, CC.TIME_Q, CC.PARALLEL_Q):
        for template in table["heldout"]:
            stem = template.split("{")[0]
            assert stem and stem not in train, template
    assert not set(CC.UNKNOWN_REAL["train"]) & set(CC.UNKNOWN_REAL["heldout"])
    assert not set(CC.HELDOUT_CITIES) & set(CC.REAL_CITIES)


def test_heldout_samples_use_heldout_tables():
    rng = random.Random(8)
    for kind in CC.SAMPLERS:
        conv = CC.sample_chat(rng, "heldout", kind, p_system=1.0)
        system = conv.messages[0]["content"]
        assert any(role in system for role in CC.ROLES["heldout"]) or any(r in system for r in CC.RULES["heldout"])
        assert not any(role in system for role in CC.ROLES["train"])


def test_the_answers_do_not_depend_on_the_system_prompt():
    for seed in range(200):
        kind = list(CC.SAMPLERS)[seed % len(CC.SAMPLERS)]
        bare = CC.sample_chat(random.Random(seed), "train", kind, p_system=0.0)
        framed = CC.sample_chat(random.Random(seed), "train", kind, p_system=1.0)
        assert framed.messages[0]["role"] == "system" and bare.messages[0]["role"] != "system"
        assert framed.messages[1:] == bare.messages


def test_unknown_countries_get_i_dont_know_and_known_ones_their_capital():
    rng = random.Random(9)
    for _ in range(100):
        conv = CC.sample_chat(rng, "train", "unknown", p_system=0.0)
        country = conv.messages[0]["content"]
        assert conv.messages[-1]["content"] == CC.IDK
        assert not any(f" {c}" in country for c in CC.CAPITALS), country
        cap = CC.sample_chat(rng, "train", "capital", p_system=0.0)
        assert cap.messages[-1]["content"] != CC.IDK


def test_client_view_learns_only_after_the_last_user_message():
    tok = ByteTokenizer(512)
    rng = random.Random(10)
    for _ in range(20):
        conv = CC.client_view(CC.sample_chat(rng, "train", "followup", p_system=0.5))
        last_user = max(i for i, m in enumerate(conv.messages) if m["role"] == "user")
        assert all("reasoning" not in m for m in conv.messages[:last_user] if m["role"] == "assistant")
        ids, mask, _ = T.encode_example(tok, conv)
        prompt = T.encode_chat(tok, conv.messages[:last_user + 1], conv.tools, add_generation_prompt=True)
        assert not any(mask[: len(prompt)]) and all(mask[len(prompt):])
        learnt = tok.decode([i for i, m in zip(ids, mask) if m])
        assert learnt.count("<|end_of_msg|>") == 1 and conv.messages[-1]["content"] in learnt


def test_json_answers_are_rendered_after_the_response_format_message():
    tok = ByteTokenizer(512)
    conv = CC.sample_chat(random.Random(11), "train", "json", p_system=0.0)
    ids, mask, _ = T.encode_example(tok, conv)
    text = tok.decode(ids)
    assert "response_format=json_object" in text
    body = json.loads(conv.messages[-1]["content"])
    assert CC.CAPITALS[body["country"]] == body["capital"]
    assert json.dumps(body, separators=(",", ":")) in tok.decode([i for i, m in zip(ids, mask) if m])
