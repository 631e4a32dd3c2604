"""The demo task's tokenizer, verifier and noisy demonstrations."""

import random

from laminar_mcore.data.tasks import (EOS, VOCAB_SIZE, addition_reward, decode, encode,
                                      make_problem, noisy_demonstrations)


def test_tokenizer_round_trip_and_reward():
    assert decode(encode("123+456=579") + [EOS, 3]) == "123+456=579"
    assert max(encode("0123456789+=")) < VOCAB_SIZE
    p = make_problem(random.Random(0), 3)
    a, b = p["prompt"][:-1].split("+")
    assert int(p["answer"]) == int(a) + int(b)
    assert addition_reward(p["answer"], p["answer"]) == 1.0
    assert addition_reward(p["answer"] + "1", p["answer"]) == 0.0


def test_noisy_demonstrations_corrupt_the_requested_fraction():
    rng = random.Random(1)
    problems = [make_problem(rng, 3) for _ in range(2000)]
    demos = noisy_demonstrations(problems, 0.4, seed=2)
    wrong = sum(decode(d)[len(p["prompt"]):] != p["answer"] for d, p in zip(demos, problems))
    assert 0.35 < wrong / len(problems) < 0.45
    assert all(d[-1] == EOS for d in demos)


def test_longtail_task_has_a_long_tail_and_exact_answers():
    """The demo's task: response lengths (answer + EOS) with p99 >= 10x p50, every answer the
    reversed prompt, and a position budget that holds the longest problem plus room."""
    from laminar_mcore.data.tasks import make_dataset, position_budget

    rows = make_dataset(4000, 3, "reverse_longtail", seed=1234, long_digits=40, long_fraction=0.08)
    lengths = sorted(len(r["answer"]) + 1 for r in rows)
    p50, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths)) - 1]
    assert p99 >= 10 * p50, (p50, p99)
    assert all(r["answer"] == r["prompt"][:-1][::-1] and r["prompt"].endswith("=") for r in rows)
    assert max(len(r["answer"]) for r in rows) == 40 and min(len(r["answer"]) for r in rows) == 1
    longest = max(len(r["prompt"]) + len(r["answer"]) + 1 for r in rows)
    assert longest + 32 <= position_budget(3, "reverse_longtail", 40) == 128
    assert position_budget(5, "reverse") == 64  # the 5-digit demo's model is unchanged
