"""A chat dataset end to end: the reward function that names `messages` gets each prompt's
conversation and responses without template tokens, and `ds-ppo samples` shows the prompt as
the chat it was."""
from __future__ import annotations

import json

from conftest import SMALL, clean_env, run_cli

REWARD = '''
import json, os

def score(prompts, responses, messages):
    with open(os.environ["SEEN"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "responses": responses,
                            "messages": messages}) + "\\n")
    return [float(len(r)) / 100 for r in responses]
'''


def test_chat_prompts_reach_the_reward_as_messages_and_samples_show_the_chat(tmp_path):
    chats = [[{"role": "system", "content": "be kind"},
              {"role": "user", "content": f"the cat {i}"}] for i in range(16)]
    with open(tmp_path / "chat.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": m}) + "\n" for m in chats)
    (tmp_path / "chat_reward.py").write_text(REWARD)
    out, seen = tmp_path / "out", tmp_path / "seen.jsonl"
    env = clean_env(PYTHONPATH=f"{tmp_path}:{clean_env()['PYTHONPATH']}", SEEN=str(seen))
    run_cli(["train", f"output_dir={out}", *SMALL, "iterations=1", "data.max_prompt_len=64",
             f"data.path={tmp_path}/chat.jsonl", "reward.function=chat_reward:score",
             "tracking.log_samples_every=1", "tracking.num_samples=2"], cwd=tmp_path, env=env)
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    prompts = [p for c in calls for p in c["prompts"]]
    messages = [m for c in calls for m in c["messages"]]
    responses = [r for c in calls for r in c["responses"]]
    assert len(messages) == 16 and all(m in chats for m in messages)
    for p, m in zip(prompts, messages):  # the text is the rendered chat of those messages
        assert p == f"system: be kind\nuser: {m[1]['content']}\nassistant:"
    assert not any(tok in r for r in responses for tok in ("<s>", "</s>", "<pad>"))
    proc = run_cli(["samples", str(out)], cwd=tmp_path, env=env)
    assert "    chat:\n      system: 'be kind'\n      user:   'the cat " in proc.stdout
    assert "prompt:" not in proc.stdout
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert all(r["messages"] in chats for r in rows)
