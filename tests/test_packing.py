"""Packing trajectories into the THD layout, micro-batch planning, and log-probs from packed
rows equal to those of each sequence alone."""

import pytest
import torch

from laminar_mcore.data import Trajectory
from laminar_mcore.testing.synthetic import random_trajectories
from laminar_mcore.trainer.logprobs import vocab_parallel_logprobs
from laminar_mcore.trainer.packing import (first_fit_decreasing, pack_trajectories,
                                           partition_balanced, plan_microbatches)


def _traj(prompt, response, reward=1.0, group="g"):
    return Trajectory(prompt_ids=prompt, response_ids=response,
                      behav_logprobs=[-0.5 - 0.1 * i for i in range(len(response))],
                      weight_version=0, group_id=group, reward=reward)


def test_layout_of_a_packed_row():
    a, b = _traj([5, 6, 7], [8, 9]), _traj([1, 2], [3, 4, 11])
    mb = pack_trajectories([a, b], [0.5, -1.0], [0, 1], tp=2)
    assert mb.cu_seqlens.tolist() == [0, 5, 10] and mb.cu_seqlens_padded.tolist() == [0, 6, 12]
    assert mb.tokens[0].tolist() == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 11, 0]
    assert mb.labels[0].tolist() == [6, 7, 8, 9, 0, 0, 2, 3, 4, 11, 0, 0]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    # position i is trained when token i+1 is a response token
    assert mb.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0]
    assert mb.behav_logprobs[0, 2:4].tolist() == pytest.approx([-0.5, -0.6])
    assert mb.behav_logprobs[0, 7:10].tolist() == pytest.approx([-0.5, -0.6, -0.7])
    assert mb.advantages[0].tolist() == [0, 0, 0.5, 0.5, 0, 0, 0, -1, -1, -1, 0, 0]
    assert mb.seq_ids[0].tolist() == [0] * 5 + [-1] + [1] * 5 + [-1]
    mask = mb.attention_mask()[0, 0]
    assert not mask[4, 0] and mask[0, 4] and mask[6, 4] and not mask[8, 6]  # causal, per sequence
    params = mb.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == 6
    assert pack_trajectories([a], [0.0], [0], tp=2, cp=2).num_tokens == 8  # multiple of 2*tp*cp


def test_trajectory_is_checked_and_round_trips():
    t = _traj([1], [2, 3])
    assert Trajectory.from_dict(t.to_dict()) == t and t.staleness(3) == 3
    with pytest.raises(ValueError, match="2 response tokens but 1 behaviour log-probs"):
        Trajectory(prompt_ids=[1], response_ids=[2, 3], behav_logprobs=[-1.0], weight_version=0,
                   group_id="g")
    with pytest.raises(ValueError, match="finish_reason"):
        Trajectory(prompt_ids=[1], response_ids=[], behav_logprobs=[], weight_version=0,
                   group_id="g", finish_reason="eos")
    with pytest.raises(ValueError, match="unknown Trajectory fields"):
        Trajectory.from_dict(dict(t.to_dict(), colour="red"))


def test_microbatch_plan_is_balanced_and_within_budget():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 200, (57,), generator=g).tolist()
    plan = plan_microbatches(lengths, 300, dp_size=4)
    seen = sorted(i for rank in plan for mb in rank for i in mb)
    assert seen == list(range(57))
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert max(loads) - min(loads) <= max(lengths)
    assert all(sum(lengths[i] for i in mb) <= 300 for rank in plan for mb in rank)
    assert first_fit_decreasing([500, 10], 100) == [[0], [1]]  # oversized item alone
    with pytest.raises(ValueError, match="cannot be spread over 4"):
        partition_balanced([1, 2, 3], 4)


@pytest.mark.parametrize("vocab,chunk", [(101, 7), (128, 1024), (37, 1)])
def test_chunked_logprobs_and_entropy_equal_log_softmax(vocab, chunk):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(53, vocab, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, vocab, (53,), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, targets, chunk_size=chunk)
    ref_ls = torch.log_softmax(logits.double(), -1)
    ref_lp = ref_ls.gather(-1, targets[:, None])[:, 0]
    ref_ent = -(ref_ls.exp() * ref_ls).sum(-1)
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)
    w1, w2 = torch.randn(53, generator=g), torch.randn(53, generator=g)
    (ours,) = torch.autograd.grad((lp * w1 + ent * w2).sum(), logits)
    (theirs,) = torch.autograd.grad((ref_lp * w1 + ref_ent * w2).sum(), logits)
    torch.testing.assert_close(ours.double(), theirs.double(), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def megatron_model():
    from laminar_mcore.models import get_adapter
    from laminar_mcore.models.hf import initial_hf_state, tiny_hf_config
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel
    from laminar_mcore.trainer.model import build_gpt_model, load_full_state

    init_trainer_parallel(tp=1, pp=1, seed=0)
    cfg = tiny_hf_config("qwen2")
    model = build_gpt_model(cfg)
    load_full_state(model, cfg, get_adapter(cfg).hf_to_mcore(
        cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 9)))
    model.eval()
    yield cfg, model
    destroy_trainer_parallel()


def test_packed_and_per_sequence_logprobs_are_the_same(megatron_model):
    cfg, model = megatron_model
    trajs = random_trajectories(3, 2, cfg.vocab_size, seed=2)
    packed = pack_trajectories(trajs, [0.0] * 6, list(range(6)), tp=2)
    with torch.no_grad():
        logits = model(packed.tokens, packed.position_ids, packed.attention_mask())
        lp, _ = vocab_parallel_logprobs(logits[0], packed.labels[0])
        for i, traj in enumerate(trajs):
            alone = pack_trajectories([traj], [0.0], [0])
            single = model(alone.tokens, alone.position_ids, None)  # plain causal attention
            ref, _ = vocab_parallel_logprobs(single[0], alone.labels[0])
            ours = lp[packed.seq_ids[0] == i]
            mask = alone.loss_mask[0].bool()
            assert mask.sum() == len(traj.response_ids)
            torch.testing.assert_close(ours[mask[: len(ours)]], ref[mask], atol=1e-5, rtol=0)


def test_a_multi_turn_trajectory_trains_only_the_tokens_the_policy_sampled():
    """A hand-built two-turn episode: prompt, turn 1 (sampled), a tool's answer and the chat
    template's markup (environment), turn 2 (sampled). Packing masks the environment tokens
    and the loss has no gradient there; it equals the loss over the sampled tokens alone."""
    from laminar_mcore.algos.losses import policy_loss

    t = Trajectory(prompt_ids=[1, 2], response_ids=[], behav_logprobs=[], weight_version=3,
                   group_id="g", reward=1.0)
    t.add_sampled([3, 4], [-0.1, -0.2])          # turn 1
    t.add_environment([7, 8, 9])                 # </turn> <tool> 42 ... <assistant>
    t.add_sampled([5, 6], [-0.3, -0.4])          # turn 2
    assert t.response_ids == [3, 4, 7, 8, 9, 5, 6] and t.loss_mask == [1, 1, 0, 0, 0, 1, 1]
    assert t.behav_logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4] and t.num_sampled == 4
    assert Trajectory.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match="loss mask of 6"):
        Trajectory(prompt_ids=[1], response_ids=t.response_ids, behav_logprobs=t.behav_logprobs,
                   weight_version=0, group_id="g", loss_mask=t.loss_mask[:-1])
    mb = pack_trajectories([t], [2.0], [0])
    # position i predicts token i+1: prompt [1 2], response from position 1 on
    assert mb.loss_mask[0].tolist() == [0, 1, 1, 0, 0, 0, 1, 1, 0]
    assert mb.behav_logprobs[0].tolist() == pytest.approx([0, -.1, -.2, 0, 0, 0, -.3, -.4, 0])
    # the loss through the decoupled-PPO objective: a gradient only at sampled positions, and
    # the same value as over the sampled tokens alone
    logprobs = torch.tensor([-1.0, -0.15, -0.25, -5.0, -6.0, -7.0, -0.2, -0.5, -9.0],
                            requires_grad=True)
    prox = logprobs.detach() + 0.05
    mask, behav, adv, seq = mb.loss_mask[0], mb.behav_logprobs[0], mb.advantages[0], mb.seq_ids[0]
    loss, _ = policy_loss("decoupled_ppo", logprobs, prox, behav, adv, mask, seq_ids=seq)
    loss.backward()
    assert (logprobs.grad != 0).tolist() == [bool(m) for m in mask.tolist()]
    keep = mask.bool()
    alone, _ = policy_loss("decoupled_ppo", logprobs.detach()[keep], prox[keep], behav[keep],
                           adv[keep], torch.ones(4), seq_ids=torch.zeros(4, dtype=torch.long))
    assert loss.item() == pytest.approx(alone.item())
