"""Expected output lengths per prompt (rollout_svc/client/expected.py) and what placement counts of them."""

from __future__ import annotations

from rollout_svc.client.expected import NEW_WEIGHT, ExpectedLengths
from rollout_svc.protocol import RolloutRequest, Trajectory


def group(prompt: list[int], lengths: list[int], finish: str = "length") -> list[Trajectory]:
    return [
        Trajectory(request_id=f"r{i}", prompt_token_ids=prompt, completion_token_ids=[5] * n, finish_reason=finish)
        for i, n in enumerate(lengths)
    ]


def test_a_prompts_expected_length_is_its_groups_mean_moving_over_epochs():
    learned, prompt = ExpectedLengths(), [1, 2, 3]
    assert learned.expected(prompt) is None
    learned.observe(prompt, group(prompt, [100, 300]))
    assert learned.expected(prompt) == 200
    learned.observe(prompt, group(prompt, [400, 400]))
    assert learned.expected(prompt) == round((1 - NEW_WEIGHT) * 200 + NEW_WEIGHT * 400)
    assert learned.expected([1, 2]) is None  # another prompt


def test_errors_and_unrun_samples_teach_nothing():
    learned, prompt = ExpectedLengths(), [9]
    learned.observe(prompt, group(prompt, [50], finish="error") + group(prompt, [0]))
    assert learned.expected(prompt) is None


def test_groups_go_longest_expected_first_unknown_ones_before_all():
    learned = ExpectedLengths()
    prompts = [[1], [2], [3], [4]]
    learned.observe(prompts[0], group(prompts[0], [10]))
    learned.observe(prompts[2], group(prompts[2], [900]))
    assert learned.order(prompts) == [(1, None), (3, None), (2, 900), (0, 10)]
    assert learned.order(prompts, by_length=False) == [(0, None), (1, None), (2, None), (3, None)]


def test_the_least_recently_sampled_prompts_are_forgotten_past_capacity():
    learned = ExpectedLengths(capacity=2)
    for p in ([1], [2], [3]):
        learned.observe(p, group(p, [7]))
    assert len(learned) == 2 and learned.expected([1]) is None and learned.expected([3]) == 7


def test_placement_counts_the_expected_length_in_place_of_max_tokens():
    request = RolloutRequest(
        request_id="r", prompt_token_ids=[1] * 100, sampling_params={"max_tokens": 1000}, reply_to="results"
    )
    assert request.cost_tokens() == 1100
    assert request.model_copy(update={"expected_tokens": 250}).cost_tokens() == 350
    assert request.model_copy(update={"expected_tokens": 5000}).cost_tokens() == 1100  # never above max_tokens
