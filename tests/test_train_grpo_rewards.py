"""train.grpo_rewards: the built-in answer and format rewards."""
from train import grpo_rewards


def test_builtin_rewards():
  completions = ["so 3 #### 3", "#### 4", "3", "#### 3\n", "####", "the answer #### 19 "]
  answers = ["3", "3", "3", "3", "3", "19"]
  assert grpo_rewards.answer_reward([""] * 6, completions, answer=answers) == [1, 0, 0, 1, 0, 1]
  assert grpo_rewards.format_reward([""] * 6, completions) == [1, 1, 0, 1, 0, 1]
