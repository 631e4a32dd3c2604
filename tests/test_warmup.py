"""The supervised warm-up that builds the demo's starting checkpoint (data/warmup.py)."""

import os

import pytest
import torch


def test_a_long_tailed_batch_in_chunks_has_the_one_pass_loss_and_gradient(monkeypatch):
    """A batch whose padded size is over CHUNK_TOKENS (one 130-token demonstration among short
    ones) runs in length-sorted chunks; the loss and the gradient are those of one padded pass
    over the whole batch, so chunking changes the cost, not the objective."""
    from transformers import AutoModelForCausalLM

    from laminar_mcore.data import tasks, warmup

    problems = tasks.make_dataset(64, 3, "reverse_longtail", seed=3, long_digits=64,
                                  long_fraction=0.15)
    assert max(len(p["answer"]) for p in problems) >= 32  # a long tail is in the batch
    data = tasks.noisy_demonstrations(problems, 0.5, seed=0)
    masks = [[0] * len(p["prompt"]) + [1] * (len(d) - len(p["prompt"]))
             for p, d in zip(problems, data)]
    picks = list(range(len(problems)))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tasks.tiny_demo_config(32, 1, 192),
                                             dtype=torch.float32)

    def loss_and_grad(chunk_tokens):
        monkeypatch.setattr(warmup, "CHUNK_TOKENS", chunk_tokens)
        model.zero_grad()
        loss = warmup._step_loss(model, data, masks, picks, tasks.PAD)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    whole, g_whole = loss_and_grad(10 ** 9)
    chunked, g_chunked = loss_and_grad(512)
    # equal up to float32 summation order (transformers computes the loss in float32); a mean
    # of the chunks' means would be off by percents
    assert chunked == pytest.approx(whole, rel=1e-5)
    assert torch.allclose(g_chunked, g_whole, rtol=1e-4, atol=1e-7)
    assert (g_whole != 0).any()


def test_the_cache_key_covers_the_whole_problem_set(tmp_path):
    """Two problem sets with the same first row and size but another long tail are two
    warm-ups (the key used to hash only the first row: a run with another data.long_digits
    reused a checkpoint warmed on other lengths)."""
    from laminar_mcore.data import tasks, warmup

    a = tasks.make_dataset(50, 3, "reverse_longtail", seed=1, long_digits=64, long_fraction=0.1)
    b = [dict(r) for r in a]
    i = next(k for k in range(1, len(b)) if len(b[k]["answer"]) <= 3)
    b[i] = {"prompt": "9" * 40 + "=", "answer": "9" * 40}
    paths = []
    for problems in (a, b):
        path = warmup.warmup_checkpoint(str(tmp_path), problems=problems, steps=1, batch_size=4,
                                        hidden=32, layers=1, max_positions=128, log=lambda *_: None)
        paths.append(path)
    assert paths[0] != paths[1]
    again = warmup.warmup_checkpoint(str(tmp_path), problems=a, steps=1, batch_size=4, hidden=32,
                                     layers=1, max_positions=128, log=lambda *_: None)
    assert again == paths[0]  # the same set is the cached one


def test_runs_sharing_a_cache_warm_the_same_recipe_at_once(tmp_path, monkeypatch):
    """Two runs (the test suite's jobs, or two users' runs with one $LAMINAR_CACHE_DIR) that
    warm the same recipe at once both get the one complete checkpoint; no temporary entry
    stays behind, whichever finishes first."""
    import subprocess
    import sys

    from laminar_mcore.data import warmup

    monkeypatch.setenv("LAMINAR_CACHE_DIR", str(tmp_path / "shared"))
    assert warmup.warmup_cache_dir("/elsewhere") == str(tmp_path / "shared")
    monkeypatch.delenv("LAMINAR_CACHE_DIR")
    assert warmup.warmup_cache_dir("out") == os.path.join("out", ".cache")
    code = ("import sys; from laminar_mcore.data import tasks, warmup; "
            "rows = tasks.make_dataset(40, 3, 'reverse', seed=1); "
            "print(warmup.warmup_checkpoint(sys.argv[1], problems=rows, steps=30, batch_size=4, "
            "hidden=32, layers=1, log=lambda *_: None))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "shared")],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    paths = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert paths[0] == paths[1] and os.path.isfile(os.path.join(paths[0], "model.safetensors"))
    assert os.listdir(tmp_path / "shared") == [os.path.basename(paths[0])]
