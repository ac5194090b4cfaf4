"""A reward function (README: "A reward function of your own"): reward.function
`examples.my_rewards:exact_answer` from the repository root. ds_ppo calls it with a batch of
prompts and responses as text and one keyword list per data.reward_keys column."""


def exact_answer(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]:
    """1.0 where the response, stripped, is the row's answer; else 0.0."""
    return [float(r.strip() == str(a).strip()) for r, a in zip(responses, answer)]
