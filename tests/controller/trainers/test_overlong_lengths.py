"""DAPO's overlong penalty counts every token a trajectory occupies of the budget, tool turns included."""

import torch

from rlframe.algos.dapo import overlong_reward_penalty
from rlframe.controller.trainers.phases import occupied_lengths
from rlframe.protocol import DataProto


def test_tool_tokens_count_against_the_budget():
    R = 8
    responses = torch.arange(2 * R).reshape(2, R)
    attention = torch.cat([torch.ones(2, 3), torch.tensor([[1] * 8, [1] * 3 + [0] * 5])], dim=1).long()
    policy = torch.tensor([[1, 1, 0, 0, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0]]).float()  # row 0: 4 tool tokens
    batch = DataProto.from_dict(tensors={"responses": responses, "attention_mask": attention, "response_mask": policy})
    lengths = occupied_lengths(batch)
    assert lengths.tolist() == [8, 3]
    penalty = overlong_reward_penalty(response_lengths=lengths, max_response_length=R, overlong_buffer_len=4,
                                      penalty_factor=1.0)
    assert penalty[0] < 0 and penalty[1] == 0  # the trajectory cut off by tool output is penalised
