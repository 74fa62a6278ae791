"""train.grpo.rewards: the built-in answer and format rewards, GSM8K's answers included."""
from train.grpo import rewards as grpo_rewards


def test_builtin_rewards():
  completions = ["so 3 #### 3", "#### 4", "3", "#### 3\n", "####", "the answer #### 19 "]
  answers = ["3", "3", "3", "3", "3", "19"]
  assert grpo_rewards.answer_reward([""] * 6, completions, answer=answers) == [1, 0, 0, 1, 0, 1]
  assert grpo_rewards.format_reward([""] * 6, completions) == [1, 1, 0, 1, 0, 1]


def test_gsm8k_answers_compare_as_its_evaluation():
  """GSM8K's answer column is reasoning, then ``#### N``: the reward compares N with the
  number after the completion's last ####, commas and a trailing period dropped on both
  sides (``#### 1,234.`` is 1234), text after the number ignored; a completion without
  the marker scores 0 even if it holds the number."""
  answer = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
  completions = ["48 + 24 = 72\n#### 72", "#### 72.", "#### 72 clips", "it is 72", "#### 7,2", "#### 27",
                 "#### 1,234.", "a #### 1 #### 72"]
  answers = [answer] * 6 + ["#### 1234", answer]
  assert grpo_rewards.answer_reward([""] * 8, completions, answer=answers) == [1, 1, 1, 0, 1, 0, 1, 1]
  assert [grpo_rewards.final_answer(t) for t in ("#### -3.50", "x\n#### 1,000,000.", "cba")] == ["-3.50", "1000000", "cba"]


def test_answer_reads_the_answer_column():
  (name, reward, weight), = grpo_rewards.reward_functions(["answer=0.5"], answer_column="final")
  assert (name, weight) == ("answer", 0.5)
  assert reward(prompts=[""], completions=["#### 8"], final=["#### 8"], answer=["9"]) == [1.0]
