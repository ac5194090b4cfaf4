"""An environment (docs/GUIDE.md: "Environments and tools"): env.function
`examples.my_env:SecondTry` from the repository root. One episode per prompt: the model answers;
a wrong answer is told so and gets one more turn, for half the reward."""
from ds_ppo.envs.base import Step


class SecondTry:
    def reset(self, prompt: str, answer: str) -> None:
        self.answer, self.turn = str(answer).strip(), 0

    def step(self, action: str) -> Step:
        self.turn += 1
        right = action.strip() == self.answer
        if right or self.turn == 2:
            reward = (1.0 if self.turn == 1 else 0.5) * right
            return Step(None, reward=reward, done=True, info={"correct": float(right)})
        return Step(" wrong, again:", reward=0.0)
