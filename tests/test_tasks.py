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
